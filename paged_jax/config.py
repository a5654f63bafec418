"""Engine configuration: vLLM's option names where one exists."""

import dataclasses
from typing import Literal

from kernels_pallas import BACKENDS, BackendChoice

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the user asks of the engine. Values found at run time (how many blocks fit, the model's
    context length) live in `ResolvedConfig`, never written back here."""

    block_size: int = 16
    # KV capacity: an explicit block count wins over a memory budget.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 2 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    dtype: str = "float32"
    attention_backend: str = "auto"
    seed: int = 0

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

        for name in ("block_size", "num_blocks", "kv_cache_memory_bytes", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len"):
            positive(name)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """The sizes the engine settled on once it knew the model and the memory budget."""

    num_blocks: int
    max_model_len: int
    max_blocks_per_seq: int
    attention: BackendChoice  # the attention backend that runs, and why
