"""The architectures the engine runs: each name (config.json's model_type, GGUF's general.architecture)
maps to its model class, its weight-name table and the config fields it fixes, here and nowhere else.

A model class is built as `cls(config, dtype=..., rngs=...)` and is what the engine calls: a
decoder.DecoderLM, whose `__call__` takes a flat ragged batch over the paged KV cache, whose `config`
is the ModelConfig it was built from, and whose `pack_for_cpu()` gives the copy the C++ CPU matmul runs.
Adding a Llama-like architecture is one entry below (with its config.json quirks in config.py, where
it has any); a family with layers of its own is a module beside llama.py (gemma3.py). The engine and
the loader look everything else up here.
"""

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from models import gemma3_weights, llama_weights, moe_weights
from models.config import ModelConfig
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_class: type
    weights: tuple[llama_weights.WeightRule, ...]  # where each Hugging Face tensor lands in the model's state
    ignored: Callable[[str, ModelConfig], bool]  # tensors a checkpoint may hold that the model does not use
    # ModelConfig fields the architecture sets where its files say nothing of them (Qwen2's q/k/v
    # biases; Gemma 3's local rotary base and activation, which its GGUF files leave to llama.cpp's code).
    traits: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


def _llama(weights=llama_weights.RULES, **traits) -> Architecture:
    return Architecture(LlamaForCausalLM, weights, llama_weights.ignored, MappingProxyType(traits))


_GEMMA3 = Architecture(Gemma3ForCausalLM, gemma3_weights.RULES, llama_weights.ignored,
                       MappingProxyType(dict(qk_norm=True, rope_local_theta=10000.0,
                                                          hidden_act="gelu_pytorch_tanh")))
# Gemma 2: Gemma 3's layers without q/k norms, one rotary base, its attention scores soft-capped.
_GEMMA2 = Architecture(Gemma3ForCausalLM, gemma3_weights.RULES, llama_weights.ignored,
                       MappingProxyType(dict(hidden_act="gelu_pytorch_tanh")))

ARCHITECTURES: dict[str, Architecture] = {
    "llama": _llama(),
    "mistral": _llama(),
    "qwen2": _llama(qkv_bias=True),  # biases on q/k/v
    "qwen3": _llama(qk_norm=True),  # RMSNorm on each q and k head before the rotation
    # Mixtures of experts (models/moe.py): Qwen3's layers, and Mistral's, with sparse MLPs.
    "qwen3_moe": _llama(moe_weights.QWEN3_MOE, qk_norm=True),
    "qwen3moe": _llama(moe_weights.QWEN3_MOE, qk_norm=True, norm_topk_prob=True),  # GGUF's name; llama.cpp renormalises
    "mixtral": _llama(moe_weights.MIXTRAL, norm_topk_prob=True),  # always renormalises its top k
    "gemma2": _GEMMA2,
    "gemma3_text": _GEMMA3,  # config.json's model_type for Gemma3ForCausalLM
    "gemma3": _GEMMA3,  # GGUF's general.architecture for the same model
}


def architecture(name: str, source: str = "model") -> Architecture:
    """The architecture called `name`; ValueError naming `source` (a file) if none is."""
    if name not in ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def traits(name: str, source: str = "model") -> Mapping[str, Any]:
    """The ModelConfig fields the architecture `name` fixes: what config.py's readers take as `traits`."""
    return architecture(name, source).traits
