"""Paged attention: a Pallas kernel for CUDA GPUs, a C++ kernel for the CPU called through XLA's FFI
(cpu_kernel.py), and a pure-XLA path (xla_cpu.py) for everything else.

`paged_attention` is the one seam the model calls; "auto" chooses by platform and dtype, and
"pallas_interpret" runs the Pallas kernel's body in the Pallas interpreter on any platform (slow: for
checking the kernel, alone or inside the engine, on a machine without a GPU).
"""

# Imported before `paged_attention` below is defined: importing a submodule binds its name on the
# package, so a later first import of kernels_pallas.paged_attention would replace the function with
# the module and `kernels_pallas.paged_attention(...)` would stop being callable.
from kernels_pallas import paged_attention as _pallas_kernel
from kernels_pallas import cpu_kernel
from kernels_pallas.layout import KVCache, bytes_per_block, gather_kv, init_kv_cache, page_shape, write_kv
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.reference import paged_attention_reference
from kernels_pallas.xla_cpu import paged_attention_xla

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "pallas", "pallas_interpret", "cpu", "xla")


def default_backend(dtype=jnp.float32, platform: str | None = None) -> str:
    """The Pallas kernel on a GPU; on the CPU the C++ kernel for float32 where it builds; else XLA.

    platform: a JAX platform name ("gpu", "cpu", ...); by default the default backend's.
    """
    platform = jax.default_backend() if platform is None else platform
    if platform == "gpu":
        return "pallas"
    if platform == "cpu" and jnp.dtype(dtype) == jnp.float32 and cpu_kernel.available():
        return "cpu"
    return "xla"


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> jax.Array:
    """q: [num_tokens, num_heads, head_dim]; pages: [num_blocks, block_size, num_kv_heads, head_dim].

    Attention runs in the pages' dtype: every backend takes q in it, so q is cast (a model whose
    weights are float32 may keep a bfloat16 cache).
    returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = default_backend(k_pages.dtype)
    args = (q.astype(k_pages.dtype), k_pages, v_pages, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc)
    if backend in ("pallas", "pallas_interpret"):
        out = _pallas_kernel.paged_attention(
            *args, max_query_len=metadata.max_query_len, scale=scale, interpret=backend == "pallas_interpret"
        )
    elif backend == "cpu":
        out = cpu_kernel.paged_attention_cpu(*args, max_query_len=metadata.max_query_len, scale=scale)
    else:
        out = paged_attention_xla(*args, max_query_len=metadata.max_query_len, scale=scale)
    return out.astype(q.dtype)


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
