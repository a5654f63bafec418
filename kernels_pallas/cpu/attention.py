"""The CPU attention kernels' Python side: paged attention (attention.cc) and the bfloat16 K/V write
(kv_write.cc), each a jax.ffi call into the library that library.py builds, told the pages' layout."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cpu.library import ATTENTION, WRITE_KV, available
from kernels_pallas.layout import TOKEN_MAJOR, page_dims, strides

PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # what the attention kernel reads


def layout_attributes(pages: jax.Array, layout: str) -> dict[str, np.int64]:
    """What the kernel is told of the pages' layout: their block size and KV heads, and the element
    strides between a page's slots and between its KV heads."""
    _, block_size, num_kv_heads, _ = page_dims(pages, layout)
    slot_stride, head_stride = strides(pages, layout)
    return dict(block_size=np.int64(block_size), num_kv_heads=np.int64(num_kv_heads),
                slot_stride=np.int64(slot_stride), head_stride=np.int64(head_stride))


def paged_attention_cpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    layout: str = TOKEN_MAJOR,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Same contract as paged_attention_reference, computed in float32 over float32 or bfloat16 pages.

    The kernel streams each sequence's pages once per KV head and work item: decode rows one token
    at a time, rows of several new tokens in query tiles whose dots run on register tiles. bfloat16
    pages are widened to float32 as they are read (exactly), so they halve the bytes read and change
    nothing else; the only error against float32 pages is the rounding of K/V when they were written.

    q: f32 [num_tokens, num_heads, head_dim]; k_pages, v_pages: f32 or bf16 pages (one dtype) in
    `layout` (layout.py; the kernel is told the layout's strides); block_tables: int32 [num_seqs,
    max_blocks_per_seq]; seq_lens: int32 [num_seqs]; query_start_loc: int32 [num_seqs + 1].
    sliding_window: a query at position p sees keys at positions > p - sliding_window (None: all).
    soft_cap: each scaled score s becomes soft_cap * tanh(s / soft_cap) (Gemma 2; None: as it is).
    Returns f32 [num_tokens, num_heads, head_dim]. max_query_len is the seam's static bound, unused:
    the kernel reads each row's length at run time.
    """
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built; use the 'xla' path")
    if q.dtype != np.float32 or k_pages.dtype not in PAGE_DTYPES or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"the CPU kernel takes float32 q and float32 or bfloat16 pages of one dtype, got {q.dtype}, "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    args = (q, k_pages, v_pages, block_tables.astype(np.int32), seq_lens.astype(np.int32),
            query_start_loc.astype(np.int32))
    call = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(*args, scale=np.float32(scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), **layout_attributes(k_pages, layout))


def write_kv_cpu(k_pages: jax.Array, v_pages: jax.Array, *, slot_mapping: jax.Array, k: jax.Array, v: jax.Array,
                 layout: str = TOKEN_MAJOR) -> tuple[jax.Array, jax.Array]:
    """layout.write_kv for bfloat16 pages on the CPU (kv_write.cc): the step's rows rounded to
    bfloat16 in place, the results aliasing the pages (donate them), nothing else of the pool touched.

    k_pages, v_pages: bf16 pages in `layout`; slot_mapping: int32 [num_tokens], negative = padding;
    k, v: [num_tokens, num_kv_heads, head_dim], any float dtype (written from float32).
    """
    attributes = layout_attributes(k_pages, layout)
    del attributes["num_kv_heads"]  # k's shape says it
    pages = jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)
    call = jax.ffi.ffi_call(WRITE_KV, (pages, pages), input_output_aliases={3: 0, 4: 1})
    return tuple(call(k.astype(jnp.float32), v.astype(jnp.float32), slot_mapping.astype(jnp.int32), k_pages, v_pages,
                      **attributes))
