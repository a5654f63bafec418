"""GGUF files (llama.cpp) as a stream of (Hugging Face name, float32 array), like a safetensors folder."""

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from models.config import ModelConfig

# llama.cpp's tensor names -> Hugging Face's, for the part after "blk.N." (or the whole name).
_HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Where an architecture names its norms otherwise: Gemma's ffn_norm is the MLP's input norm, and its
# attention and MLP outputs have norms of their own.
_GEMMA_NAMES = _HF_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Mixtures of experts: the router, and each expert's projection, which the file stacks over experts
# ("{e}": `tensors` yields one tensor per expert, as a Hugging Face checkpoint holds them).
_QWEN3_MOE_NAMES = _HF_NAMES | {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_MIXTRAL_NAMES = _HF_NAMES | {  # a "llama" file with experts (config.from_gguf_metadata)
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}
_ARCH_NAMES = {"gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES, "qwen3moe": _QWEN3_MOE_NAMES, "mixtral": _MIXTRAL_NAMES}
# Architectures whose norms are (1 + w): llama.cpp's converter stores 1 + w, Hugging Face's checkpoints w.
_UNIT_OFFSET_NORMS = {"gemma2", "gemma3"}
_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key/value field as a Python value (str, int, float, list)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_name(name: str, architecture: str = "llama") -> str:
    """llama.cpp tensor name -> Hugging Face name, for `architecture` (GGUF's general.architecture);
    names without a counterpart come back unchanged."""
    names = _ARCH_NAMES.get(architecture, _HF_NAMES)
    match = _NAME.fullmatch(name)
    if match is None or match[2] not in names:
        return name
    layer, part, kind = match.groups()
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{names[part]}.{kind}"


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """w: [num_heads * head_dim, hidden] as llama.cpp's convert script stored it, rows of each head
    interleaved (x0, x_half, x1, x_half+1, ...) for its pairwise rope -> rotate_half order."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(reader: gguf.GGUFReader, config: ModelConfig, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array in Hugging Face's shape), dequantized one tensor at a time."""
    for tensor in reader.tensors:
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{path}: tensor {tensor.name} has quantization type {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from None
        name = hf_name(tensor.name, config.architecture)
        if config.architecture in _UNIT_OFFSET_NORMS and name.endswith("norm.weight"):
            array = array - 1.0
        # Only the "llama" architecture's q/k are permuted by llama.cpp (Qwen2 uses NeoX-style rope), Mixtral's
        # among them. A tensor of the wrong shape passes through untouched for the loader to report.
        if config.architecture in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if name.endswith("q_proj.weight") else config.num_kv_heads
            if array.shape[0] == heads * config.head_dim:
                array = _unpermute(array, heads)
        if "{e}" in name:  # [num_experts, out, in]: one tensor per expert
            yield from ((name.format(e=e), expert) for e, expert in enumerate(array))
        else:
            yield name, array
