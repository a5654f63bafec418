"""The converted-model cache: what is saved loads back the same, and a second load of a GGUF never
opens the file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import converted, load_model
from models.loader import assemble, cache_dir, convert, _safetensors_files, _safetensors_tensors
from models.config import ModelConfig


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_saved_params_load_back_equal(tiny_checkpoint, tmp_path, dtype):
    folder, _ = tiny_checkpoint("llama3")  # has rope scaling: the config's nested part round-trips too
    model = load_model(folder, dtype=dtype)
    files = [(f, _safetensors_tensors(f)) for f in _safetensors_files(folder)]
    params = convert(model.config, files, dtype=jnp.dtype(dtype), source=folder)
    converted.save(tmp_path / "saved", model.config, params, None)
    config, loaded, tokenizer = converted.load(tmp_path / "saved", jnp.dtype(dtype))
    assert config == model.config and tokenizer is None
    again = assemble(config, loaded, dtype=jnp.dtype(dtype))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model.model), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_nothing_saved_is_none(tmp_path):
    assert converted.load(tmp_path / "nothing", jnp.dtype(jnp.float32)) is None


def test_params_of_another_layout_are_refused(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("qwen2")
    model = load_model(folder)
    files = [(f, _safetensors_tensors(f)) for f in _safetensors_files(folder)]
    params = convert(model.config, files, dtype=jnp.dtype(jnp.float32), source=folder)
    path = ("layers", 0, "attn", "o")
    params[path] = params[path][:-1]
    with pytest.raises(ValueError, match=r"parameter layers\.0\.attn\.o: float32\[63, 64\], expected float32\[64, 64\]"):
        assemble(model.config, params, dtype=jnp.dtype(jnp.float32))


def test_second_load_of_a_gguf_does_not_open_it(monkeypatch):
    first = load_model("smollm2-135m")  # converts, or finds the conversion an earlier run saved
    assert any((cache_dir() / "models").glob("SmolLM2-135M-Instruct*"))

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was opened again")

    monkeypatch.setattr("gguf.GGUFReader", refuse)
    second = load_model("smollm2-135m")
    assert isinstance(second.config, ModelConfig) and second.config == first.config
    for a, b in zip(jax.tree.leaves(second.model), jax.tree.leaves(first.model), strict=True):
        np.testing.assert_array_equal(a, b)
    text = "Explain PagedAttention in one paragraph"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
