"""The architectures the engine runs: each name (config.json's model_type, GGUF's general.architecture)
maps to its model class and its weight-name table, here and nowhere else.

A model class is built as `cls(config, dtype=..., rngs=...)` and is what the engine calls: its
`__call__` is LlamaForCausalLM.__call__'s (a flat ragged batch over the paged KV cache), its `config` is
the ModelConfig it was built from, and `pack_for_cpu()` gives the copy the C++ CPU matmul runs.
Adding a Llama-like architecture is one entry below (with its config.json quirks in config.py, where
it has any); the engine and the loader look everything else up here.
"""

import dataclasses
from collections.abc import Callable

from models import llama_weights
from models.config import ModelConfig
from models.llama import LlamaForCausalLM


@dataclasses.dataclass(frozen=True)
class Architecture:
    model_class: type
    weights: tuple[llama_weights.WeightRule, ...]  # where each Hugging Face tensor lands in the model's state
    ignored: Callable[[str, ModelConfig], bool]  # tensors a checkpoint may hold that the model does not use


_LLAMA = Architecture(LlamaForCausalLM, llama_weights.RULES, llama_weights.ignored)

ARCHITECTURES: dict[str, Architecture] = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA}


def architecture(name: str, source: str = "model") -> Architecture:
    """The architecture called `name`; ValueError naming `source` (a file) if none is."""
    if name not in ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
