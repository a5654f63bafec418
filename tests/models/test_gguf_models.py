"""Qwen3, Gemma 3, Gemma 2, Qwen3-MoE and Mixtral from GGUF files written as llama.cpp's converter writes
them (its tensor names and metadata keys; Gemma's norms stored as 1 + w; Gemma's matmul weights in Q8_0;
experts stacked): the loaded config, and greedy tokens through the paged cache equal to transformers'.
The Gemmas' files are read by transformers' own GGUF loader too, an independent reading of the same
names and keys."""

import gguf
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from conftest import _TINY, hf_greedy
from models import load_model
from test_models import GREEDY_STEPS, make_forward, paged_greedy, random_prompts

# Hugging Face name (after "model.layers.N." or alone) -> llama.cpp's, per architecture.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_NAMES = {
    "qwen3": _LAYER_NAMES | {"post_attention_layernorm": "ffn_norm"},
    "gemma3": _LAYER_NAMES | {"post_attention_layernorm": "post_attention_norm",
                              "pre_feedforward_layernorm": "ffn_norm",
                              "post_feedforward_layernorm": "post_ffw_norm"},
}
_NAMES["gemma2"] = _NAMES["gemma3"]
# transformers holds a sparse layer's experts fused and stacked (gate and up in one); llama.cpp's files
# hold them stacked, gate and up apart, and name the router ffn_gate_inp.
_NAMES["qwen3moe"] = _NAMES["llama"] = _NAMES["qwen3"] | {"mlp.gate": "ffn_gate_inp"}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str, arch: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    if part.startswith("mlp.experts."):  # already llama.cpp's name (moe_tensors)
        return f"blk.{layer}.{part.removeprefix('mlp.experts.')}.{kind}"
    return f"blk.{layer}.{_NAMES[arch][part]}.{kind}"


def moe_tensors(state_dict):
    """(name, float32 array) of a transformers state dict, each sparse layer's fused experts split into
    llama.cpp's three stacked tensors [num_experts, out, in] (named by their llama.cpp names)."""
    for name, tensor in state_dict.items():
        data = tensor.numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * intermediate, hidden], gate first
            gate, up = np.split(data, 2, axis=1)
            yield name.replace("gate_up_proj", "ffn_gate_exps.weight"), gate
            yield name.replace("gate_up_proj", "ffn_up_exps.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            yield name.replace("down_proj", "ffn_down_exps.weight"), data
        else:
            yield name, data


def write_gguf(path, hf_model, arch: str, *, q8_0: bool):
    """`hf_model` as llama.cpp's convert_hf_to_gguf.py writes it, without a tokenizer; q8_0: its matmul
    weights and embedding in Q8_0, else everything in float32."""
    c = hf_model.config
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads  # Mixtral's config may leave it None
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters.get("full_attention", c.rope_parameters)["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    if arch.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if experts := getattr(c, "num_experts", 0):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
            if not c.norm_topk_prob:  # what llama.cpp's qwen3moe assumes unless the file says otherwise
                writer.add_expert_weights_norm(False)
    tied = c.tie_word_embeddings
    for name, data in moe_tensors(hf_model.state_dict()):
        if tied and name == "lm_head.weight":
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's rope order
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(data.shape)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1.0
        if q8_0 and data.ndim == 2 and data.shape[1] % 32 == 0:
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name, arch), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gemma(model_class, config):
    torch.manual_seed(0)
    hf_model = model_class(config).eval()
    with torch.no_grad():  # as conftest.make_tiny_model draws them
        for name, param in hf_model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.15)
    return hf_model


def gemma_gguf(tmp_path_factory, arch: str, hf_model):
    """hf_model's file, and transformers' reading of that file."""
    path = write_gguf(tmp_path_factory.mktemp(f"{arch}-gguf") / f"tiny-{arch}.gguf", hf_model, arch, q8_0=True)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    return path, theirs


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory):
    """A tiny Gemma 3 as its GGUF files can describe it (llama.cpp's fixed pattern of five sliding layers
    to one full, local base 10,000, the scale head_dim**-0.5, no logit cap), its file, and transformers'
    reading of that file."""
    config = Gemma3TextConfig(**_TINY | dict(num_hidden_layers=6), head_dim=256, sliding_window=8)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and config.query_pre_attn_scalar == 256
    return gemma_gguf(tmp_path_factory, "gemma3", tiny_gemma(Gemma3ForCausalLM, config))


@pytest.fixture(scope="module")
def gemma2_gguf(tmp_path_factory):
    """A tiny Gemma 2 as its GGUF files describe it (every second layer sliding, the scale head_dim**-0.5,
    its two soft caps in the file; transformers' GGUF reading takes Gemma 2's default caps, 50 and 30)."""
    config = Gemma2Config(**_TINY | dict(num_hidden_layers=4), head_dim=256, sliding_window=8)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping, config.query_pre_attn_scalar) == (50, 30, 256)
    return gemma_gguf(tmp_path_factory, "gemma2", tiny_gemma(Gemma2ForCausalLM, config))


def _greedy(loaded, prompts):
    graphdef, state = nnx.split(loaded.model)
    return paged_greedy(make_forward(graphdef), state, loaded.config, prompts, block_size=4, chunk_size=5)


def test_gemma3_gguf_matches_transformers_reading_it(gemma3_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", str(tmp_path))  # the conversion is saved there, not in ~/.cache
    path, theirs = gemma3_gguf
    loaded = load_model(path)
    c = loaded.config
    assert (c.architecture, c.head_dim, c.sliding_window, c.hidden_act) == ("gemma3", 256, 8, "gelu_pytorch_tanh")
    assert [c.window(i) for i in range(6)] == [8] * 5 + [None]
    assert (c.rope_theta, c.rope_local_theta, c.attention_scale, c.qk_norm) == (1e6, 1e4, 256**-0.5, True)
    assert c.tie_word_embeddings and c.final_logit_softcapping is None
    prompts = random_prompts(c, (9, 23, 14))
    assert _greedy(loaded, prompts) == [hf_greedy(theirs, p, GREEDY_STEPS) for p in prompts]
    # Loaded again from the converted copy in the cache: the same config, the same tokens.
    again = load_model(path)
    assert again.config == c and _greedy(again, prompts[:1]) == _greedy(loaded, prompts[:1])


def test_gemma2_gguf_matches_transformers_reading_it(gemma2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", str(tmp_path))
    path, theirs = gemma2_gguf
    loaded = load_model(path)
    c = loaded.config
    assert (c.architecture, c.qk_norm, c.rope_local_theta, c.attention_scale) == ("gemma2", False, None, 256**-0.5)
    assert [c.window(i) for i in range(4)] == [8, None, 8, None]
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    prompts = random_prompts(c, (9, 23, 14))
    assert _greedy(loaded, prompts) == [hf_greedy(theirs, p, GREEDY_STEPS) for p in prompts]


def test_qwen3_gguf_matches_its_checkpoint(tiny_checkpoint, tmp_path, monkeypatch):
    """transformers reads no head_dim from a Qwen3 GGUF, so the checkpoint the file was written from is
    the reference here, and the file holds its weights exactly (float32)."""
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", str(tmp_path))
    _, hf_model = tiny_checkpoint("qwen3")
    loaded = load_model(write_gguf(tmp_path / "tiny-qwen3.gguf", hf_model, "qwen3", q8_0=False))
    c = loaded.config
    assert (c.architecture, c.head_dim, c.qk_norm, c.window(0)) == ("qwen3", 32, True, None)
    prompts = random_prompts(c, (9, 23, 14))
    assert _greedy(loaded, prompts) == [hf_greedy(hf_model, p, GREEDY_STEPS) for p in prompts]


@pytest.mark.parametrize("arch, gguf_arch", [("qwen3_moe", "qwen3moe"), ("qwen3_moe_odd", "qwen3moe"),
                                             ("mixtral", "llama")])
def test_moe_gguf_matches_its_checkpoint(tiny_checkpoint, tmp_path, monkeypatch, arch, gguf_arch):
    """Qwen3-MoE as "qwen3moe", Mixtral as llama.cpp writes it: a "llama" file with experts (q/k in its
    rope order); experts stacked in ffn_{gate,up,down}_exps, a dense layer's MLP as ever. The files are
    float32, so greedy tokens equal the checkpoint's, as for Qwen3."""
    monkeypatch.setenv("PAGED_JAX_CACHE_DIR", str(tmp_path))
    _, hf_model = tiny_checkpoint(arch)
    loaded = load_model(write_gguf(tmp_path / f"tiny-{arch}.gguf", hf_model, gguf_arch, q8_0=False))
    c, hc = loaded.config, hf_model.config
    assert c.architecture == {"qwen3moe": "qwen3moe", "llama": "mixtral"}[gguf_arch]
    assert (c.num_experts, c.num_experts_per_tok) == (hc.num_experts, hc.num_experts_per_tok)
    assert c.moe_intermediate_size == getattr(hc, "moe_intermediate_size", hc.intermediate_size)
    assert c.norm_topk_prob == getattr(hc, "norm_topk_prob", True)  # Mixtral's always
    assert [c.sparse(i) for i in range(c.num_layers)] == [type(layer.mlp).__name__.endswith("SparseMoeBlock")
                                                          for layer in hf_model.model.layers]
    prompts = random_prompts(c, (9, 23, 14))
    assert _greedy(loaded, prompts) == [hf_greedy(hf_model, p, GREEDY_STEPS) for p in prompts]
