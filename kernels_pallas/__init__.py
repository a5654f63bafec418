"""Paged attention: a Pallas kernel for CUDA GPUs, a C++ kernel for the CPU called through XLA's FFI
(cpu/kernel.py), and a pure-XLA path (cpu/xla.py) for everything else.

`paged_attention` is the one seam the model calls; "auto" chooses by platform and dtype, and
"pallas_interpret" runs the Pallas kernel's body in the Pallas interpreter on any platform (slow: for
checking the kernel, alone or inside the engine, on a machine without a GPU).
"""

# Imported before `paged_attention` below is defined: importing a submodule binds its name on the
# package, so a later first import of kernels_pallas.paged_attention would replace the function with
# the module and `kernels_pallas.paged_attention(...)` would stop being callable.
from kernels_pallas import paged_attention as _pallas_kernel
from kernels_pallas.cpu import kernel as cpu_kernel
from kernels_pallas import layout as _layout
from kernels_pallas.layout import LAYOUTS, TOKEN_MAJOR, KVCache, bytes_per_block, gather_kv, init_kv_cache, page_shape
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.reference import paged_attention_reference
from kernels_pallas.cpu.xla import paged_attention_xla

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

BACKENDS = ("auto", "pallas", "pallas_interpret", "cpu", "xla")


class BackendChoice(NamedTuple):
    backend: str  # one of BACKENDS other than "auto"
    reason: str  # why, in words
    fallback: bool  # the platform's kernel could not be used, and a slower path runs instead


def choose_backend(requested: str = "auto", dtype=jnp.float32, platform: str | None = None, *,
                   kv_dtype=None) -> BackendChoice:
    """The backend that runs when `requested` is asked for by a model computing in `dtype` over
    `kv_dtype` pages (by default `dtype` too), and why.

    "auto" takes the Pallas kernel on a GPU; on the CPU the C++ kernel for float32 compute over
    float32 or bfloat16 pages where it builds; else XLA. platform: a JAX platform name ("gpu",
    "cpu", ...); by default the default backend's.
    """
    if requested != "auto":
        return BackendChoice(requested, "asked for", False)
    platform = jax.default_backend() if platform is None else platform
    kv_dtype = jnp.dtype(dtype if kv_dtype is None else kv_dtype)
    if platform == "gpu":
        return BackendChoice("pallas", "the Pallas kernel on a GPU", False)
    if platform != "cpu":
        return BackendChoice("xla", f"no kernel for the {platform} platform", False)
    if jnp.dtype(dtype) != jnp.float32:
        return BackendChoice("xla", f"the CPU kernel takes float32, not {jnp.dtype(dtype)}", False)
    if kv_dtype not in cpu_kernel.PAGE_DTYPES:
        return BackendChoice("xla", f"the CPU kernel reads float32 or bfloat16 pages, not {kv_dtype}", False)
    if (error := cpu_kernel.build_error()) is not None:
        return BackendChoice("xla", f"the CPU kernel is unavailable: {error}", True)
    pages = "" if kv_dtype == jnp.float32 else f" over {kv_dtype} pages"
    return BackendChoice("cpu", f"the C++ kernel for float32{pages} on the CPU", False)


def default_backend(dtype=jnp.float32, platform: str | None = None, *, kv_dtype=None) -> str:
    """What "auto" runs for a model computing in `dtype` over `kv_dtype` pages (choose_backend says why)."""
    return choose_backend("auto", dtype, platform, kv_dtype=kv_dtype).backend


def allocate_pages(shape: tuple[int, ...], dtype) -> jax.Array:
    """KV pages for the engine. On the CPU, where the kernel library builds, the memory is allocated
    and not written (cpu_kernel.unwritten): the OS maps it as blocks are first written, so a large KV
    budget costs neither start-up time nor memory until used. Elsewhere zeros. Page contents are
    never trusted: every path masks by length."""
    if jax.default_backend() == "cpu" and cpu_kernel.available():
        return cpu_kernel.unwritten(shape, dtype)
    return jnp.zeros(shape, dtype)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, slot_mapping: jax.Array, k: jax.Array, v: jax.Array,
    layout: str = TOKEN_MAJOR,
) -> tuple[jax.Array, jax.Array]:
    """layout.write_kv (the same arguments and result), but bfloat16 pages on the CPU are written by
    the C++ kernel (kv_write.cc) in place: XLA's CPU scatter would convert the whole pool to float32
    and back at every step."""
    scatter = functools.partial(_layout.write_kv, slot_mapping=slot_mapping, k=k, v=v, layout=layout)
    if k_pages.dtype == jnp.bfloat16 and cpu_kernel.available():
        write = functools.partial(cpu_kernel.write_kv_cpu, slot_mapping=slot_mapping, k=k, v=v, layout=layout)
        return jax.lax.platform_dependent(k_pages, v_pages, cpu=write, default=scatter)
    return scatter(k_pages, v_pages)


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    backend: str = "auto",
    layout: str = TOKEN_MAJOR,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """q: [num_tokens, num_heads, head_dim]; pages in `layout` (layout.LAYOUTS): token-major
    [num_blocks, block_size, num_kv_heads, head_dim] or head-major [num_blocks, num_kv_heads,
    block_size, head_dim]. Every backend reads either.
    sliding_window: a static int, or None. A query at position p attends only to keys at positions
    > p - sliding_window (the layer's window, Mistral's and Gemma's sliding layers); every backend
    reads only those keys' pages.
    soft_cap: a static float, or None: each scaled score s becomes soft_cap * tanh(s / soft_cap) before
    the softmax (Gemma 2's attention logit soft-capping).

    A float32 model may keep a bfloat16 cache (EngineConfig.kv_cache_dtype). The CPU backends
    compute in float32 whatever the pages hold, so they take q as float32 (the C++ kernel always:
    q is cast up); the Pallas kernel and the reference attend in the pages' dtype, so q is cast to it.
    returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = default_backend(q.dtype, kv_dtype=k_pages.dtype)
    if backend == "cpu" or (backend == "xla" and q.dtype == jnp.float32):
        q_in = q.astype(jnp.float32)
    else:
        q_in = q.astype(k_pages.dtype)
    args = (q_in, k_pages, v_pages, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    options = dict(max_query_len=metadata.max_query_len, scale=scale, layout=layout, sliding_window=sliding_window,
                   soft_cap=soft_cap)
    if backend in ("pallas", "pallas_interpret"):
        out = _pallas_kernel.paged_attention(*args, **options, interpret=backend == "pallas_interpret")
    elif backend == "cpu":
        out = cpu_kernel.paged_attention_cpu(*args, **options)
    else:
        out = paged_attention_xla(*args, **options)
    return out.astype(q.dtype)


__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "BackendChoice",
    "KVCache",
    "LAYOUTS",
    "allocate_pages",
    "bytes_per_block",
    "choose_backend",
    "init_kv_cache",
    "default_backend",
    "gather_kv",
    "page_shape",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_xla",
    "write_kv",
]
