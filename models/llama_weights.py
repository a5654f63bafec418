"""Where each tensor of a Llama-family Hugging Face checkpoint lands in LlamaForCausalLM's state, and the
placing helpers other families' tables reuse (gemma3_weights.py).

One rule per Hugging Face tensor name: the state path of the (fused) parameter it fills, the shape the
config implies for it, and how its array is placed there (transposed, into its q/k/v or gate/up slots).
The loader applies the table of the checkpoint's architecture (registry.py), whatever the file format.
"""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from models.config import ModelConfig

Place = Callable[[np.ndarray, ModelConfig], tuple[Any, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One Hugging Face tensor (its name with "{i}" for the layer, "{e}" for the expert) and where it lands.
    An expert's tensor fills that expert's entry of a parameter stacked over experts: the loader puts the
    expert's index before the one `place` gives."""

    hf: str
    param: str  # path in the model's state, dotted, "{i}" for the layer
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    place: Place  # (HF array, config) -> (index into the param, value to store there)
    needed: Callable[[ModelConfig], bool] = lambda c: True
    layers: Callable[[ModelConfig], Iterable[int]] = lambda c: range(c.num_layers)  # the layers that have it


def whole(a: np.ndarray, c: ModelConfig):
    return ..., a


def transposed(a: np.ndarray, c: ModelConfig):
    """torch Linear's [out, in] -> our [in, out]."""
    return ..., a.T


def _heads(c: ModelConfig, part: str) -> int:
    return c.num_heads if part == "q" else c.num_kv_heads


def qkv(part: str) -> Place:
    """q, k or v ([out, in] weight or [out] bias) into its slots of [..., num_kv_heads, group + 2, head_dim]."""

    def place(a: np.ndarray, c: ModelConfig):
        start = {"q": 0, "k": c.group_size, "v": c.group_size + 1}[part]
        n = _heads(c, part) // c.num_kv_heads
        a = a.T if a.ndim == 2 else a
        return (..., slice(start, start + n), slice(None)), a.reshape(*a.shape[:-1], c.num_kv_heads, n, c.head_dim)

    return place


def gate_up(slot: int) -> Place:
    """gate (0) or up (1), [intermediate, hidden], into [hidden, 2, intermediate]."""
    return lambda a, c: (np.s_[:, slot], a.T)


def hidden(c: ModelConfig) -> tuple[int, ...]:
    return (c.hidden_size,)


def head_dim(c: ModelConfig) -> tuple[int, ...]:
    return (c.head_dim,)


def dense_layers(c: ModelConfig) -> list[int]:
    """The layers with a dense MLP: all but a mixture of experts' sparse ones (models/moe.py)."""
    return [i for i in range(c.num_layers) if not c.sparse(i)]


LAYER = "model.layers.{i}."
# The rules every family's attention and MLP share: q/k/v (and their biases), the q/k norms, o, gate/up/down.
ATTENTION_MLP = (
    *(
        WeightRule(LAYER + f"self_attn.{p}_proj.weight", "layers.{i}.attn.qkv",
              lambda c, p=p: (_heads(c, p) * c.head_dim, c.hidden_size), qkv(p))
        for p in "qkv"
    ),
    *(
        WeightRule(LAYER + f"self_attn.{p}_proj.bias", "layers.{i}.attn.qkv_bias",
              lambda c, p=p: (_heads(c, p) * c.head_dim,), qkv(p), needed=lambda c: c.qkv_bias)
        for p in "qkv"
    ),
    *(
        WeightRule(LAYER + f"self_attn.{p}_norm.weight", f"layers.{{i}}.attn.{p}_norm.weight", head_dim, whole,
                   needed=lambda c: c.qk_norm)
        for p in "qk"
    ),
    WeightRule(LAYER + "self_attn.o_proj.weight", "layers.{i}.attn.o",
          lambda c: (c.hidden_size, c.num_heads * c.head_dim), transposed),
    WeightRule(LAYER + "mlp.gate_proj.weight", "layers.{i}.mlp.gate_up",
          lambda c: (c.intermediate_size, c.hidden_size), gate_up(0), layers=dense_layers),
    WeightRule(LAYER + "mlp.up_proj.weight", "layers.{i}.mlp.gate_up",
          lambda c: (c.intermediate_size, c.hidden_size), gate_up(1), layers=dense_layers),
    WeightRule(LAYER + "mlp.down_proj.weight", "layers.{i}.mlp.down",
          lambda c: (c.hidden_size, c.intermediate_size), transposed, layers=dense_layers),
)
# The embedding, the lm_head where it is not tied, the final norm.
EMBED_HEAD = (
    WeightRule("model.embed_tokens.weight", "embed", lambda c: (c.vocab_size, c.hidden_size), whole),
    WeightRule("lm_head.weight", "lm_head", lambda c: (c.vocab_size, c.hidden_size), transposed,
          needed=lambda c: not c.tie_word_embeddings),
    WeightRule("model.norm.weight", "norm.weight", hidden, whole),
)
RULES = (
    *EMBED_HEAD,
    WeightRule(LAYER + "input_layernorm.weight", "layers.{i}.input_norm.weight", hidden, whole),
    WeightRule(LAYER + "post_attention_layernorm.weight", "layers.{i}.post_attention_norm.weight", hidden, whole),
    *ATTENTION_MLP,
)


def ignored(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that the model does not use: older checkpoints store rope
    tables; some tied ones store the embedding again as lm_head."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)
