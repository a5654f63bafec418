"""Paged attention: a Pallas kernel for CUDA GPUs and an XLA path (xla_cpu.py) for everything else.

`paged_attention` is the one seam the model calls; the backend is chosen once, by platform.
"""

# Imported before `paged_attention` below is defined: importing a submodule binds its name on the
# package, so a later first import of kernels_pallas.paged_attention would replace the function with
# the module and `kernels_pallas.paged_attention(...)` would stop being callable.
from kernels_pallas import paged_attention as _pallas_kernel
from kernels_pallas.layout import KVCache, bytes_per_block, gather_kv, init_kv_cache, page_shape, write_kv
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.reference import paged_attention_reference
from kernels_pallas.xla_cpu import paged_attention_xla

import jax

BACKENDS = ("auto", "pallas", "xla")


def default_backend() -> str:
    """The Pallas kernel on a GPU, the XLA path everywhere else."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:
    """q: [num_tokens, num_heads, head_dim]; pages: [num_blocks, block_size, num_kv_heads, head_dim].

    interpret: run the Pallas kernel in the Pallas interpreter (backend "pallas" off a GPU, for tests).
    returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = default_backend()
    args = (q, k_pages, v_pages, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc)
    if backend == "pallas":
        return _pallas_kernel.paged_attention(
            *args, max_query_len=metadata.max_query_len, scale=scale, interpret=interpret
        )
    return paged_attention_xla(*args, max_query_len=metadata.max_query_len, scale=scale)


__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "KVCache",
    "bytes_per_block",
    "init_kv_cache",
    "default_backend",
    "gather_kv",
    "page_shape",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "write_kv",
]
