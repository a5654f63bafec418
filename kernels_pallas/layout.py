"""The paged KV cache layout: the one place that knows how pages are laid out in memory.

Per layer, K and V each live in one array of pages, in one of two layouts chosen per engine
(`EngineConfig.kv_layout`):

    "token_major": [num_blocks, block_size, num_kv_heads, head_dim]   (vLLM's flash-attention backend)
    "head_major":  [num_blocks, num_kv_heads, block_size, head_dim]   (vLLM's CPU backend; JAX's GPU
                                                                       kernel, with the block axis inside)

Token-major: writing a new token is one contiguous run of num_kv_heads * head_dim values, so the
step's scatter through the slot mapping touches one cache-line run per token; gathering a sequence's
pages reshapes for free into contiguous [tokens, kv_heads, head_dim] K/V. A kernel reading one
(block, kv_head) tile reads block_size rows of head_dim with a stride of num_kv_heads * head_dim.

Head-major: one (block, kv_head) tile is block_size * head_dim contiguous values, which is what an
attention kernel reads (one KV head's group of query heads against a page), so reads stream; writing
a token scatters num_kv_heads runs of head_dim. scripts/compare_layouts.py measures the difference.

Everything else reaches the layout through this module: `head_axis` says which axis holds the KV
heads (models/sharding.py splits it), `index` orders a (block, slot, head, dim)
index for the layout, `page_dims` reads the four sizes back, `strides` gives the element strides a
kernel needs, `tokens_first` / `heads_first` turn gathered pages into contiguous K/V, `write_kv`
scatters new tokens (`set_pages` / `get_pages` index pages of any dtype without converting the
pool). The block axis is first in both, so whole-block copies (copy-on-write, swap) need not know
the layout. `to_jax_layout` converts for comparisons against JAX's own Pallas kernel,
whose pages are [num_kv_heads, num_blocks, block_size, head_dim].
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"
LAYOUTS = (TOKEN_MAJOR, HEAD_MAJOR)
# The order of a page's two middle axes; the block axis is first and head_dim last in every layout.
_MIDDLE_AXES = {TOKEN_MAJOR: ("slot", "head"), HEAD_MAJOR: ("head", "slot")}


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be one of {LAYOUTS}, got {layout!r}")


def _axis(layout: str, name: str) -> int:
    """Position of the "slot" (token within the block) or "head" (KV head) axis in a page array."""
    check_layout(layout)
    return 1 + _MIDDLE_AXES[layout].index(name)


def head_axis(layout: str) -> int:
    """Position of the KV-head axis in a page array: the axis tensor parallelism splits."""
    return _axis(layout, "head")


def index(layout: str, block, slot, head, dim) -> tuple:
    """A (block, slot, head, dim) index, or shape, in the order of `layout`'s axes."""
    check_layout(layout)
    named = dict(slot=slot, head=head)
    return (block, *(named[name] for name in _MIDDLE_AXES[layout]), dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's pages; a pytree to donate to the jitted step so it is updated in place.

    k[i], v[i]: the pages of layer i in `layout` (one array per layer, so a layer's read and write
    never slice a larger buffer). Change pages with dataclasses.replace, which keeps the layout.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    layout: str = dataclasses.field(default=TOKEN_MAJOR, metadata=dict(static=True))

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[_axis(self.layout, "slot")]


def init_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
    *, layout: str = TOKEN_MAJOR, allocate=jnp.zeros,
) -> KVCache:
    """Every layer's pages in `layout`, each made by allocate(shape, dtype): zeros unless told otherwise."""
    shape = page_shape(num_blocks, block_size, num_kv_heads, head_dim, layout)
    return KVCache(
        k=tuple(allocate(shape, dtype) for _ in range(num_layers)),
        v=tuple(allocate(shape, dtype) for _ in range(num_layers)),
        layout=layout,
    )


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """KV bytes one block holds across all layers (K and V), in any layout."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def page_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
               layout: str = TOKEN_MAJOR) -> tuple[int, ...]:
    """Shape of one layer's K (or V) pages."""
    return index(layout, num_blocks, block_size, num_kv_heads, head_dim)


def page_dims(pages: jax.Array, layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_dim) of one layer's pages in `layout`."""
    shape = pages.shape
    return shape[0], shape[_axis(layout, "slot")], shape[_axis(layout, "head")], shape[3]


def strides(pages: jax.Array, layout: str) -> tuple[int, int]:
    """Elements between consecutive slots of a page and between consecutive KV heads:
    (slot_stride, head_stride), for kernels that address pages themselves (row-major arrays)."""
    row_major = [math.prod(pages.shape[axis + 1:]) for axis in range(4)]
    return row_major[_axis(layout, "slot")], row_major[_axis(layout, "head")]


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, slot_mapping: jax.Array, k: jax.Array, v: jax.Array,
    layout: str = TOKEN_MAJOR,
) -> tuple[jax.Array, jax.Array]:
    """Scatter a step's new K/V into the pages, with XLA's scatter (kernels_pallas.write_kv, which the
    model calls, takes the CPU kernel for bfloat16 pages instead).

    k_pages, v_pages: pages in `layout` (donate them to the caller's jit so the update happens in place).
    slot_mapping: int32 [num_tokens]; physical slot block * block_size + offset, negative for
        padding tokens, which are not written.
    k, v: [num_tokens, num_kv_heads, head_dim], cast to the pages' dtype.
    """
    num_blocks, block_size, _, _ = page_dims(k_pages, layout)
    # Padding goes to block num_blocks, out of bounds, and mode="drop" discards it (negative
    # indices would wrap). In either layout the indexed view is [num_tokens, kv_heads, head_dim]:
    # NumPy's rules put the broadcast (block, slot) axes first even when a slice separates them.
    block = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    at = index(layout, block, slot_mapping % block_size, slice(None), slice(None))
    return _scatter(k_pages, at, k), _scatter(v_pages, at, v)


def _scatter(pages: jax.Array, at, values: jax.Array) -> jax.Array:
    return pages.at[at].set(values.astype(pages.dtype), mode="drop")


def set_pages(pages: jax.Array, at, values: jax.Array) -> jax.Array:
    """pages.at[at].set(values, mode="drop"), values cast to the pages' dtype: for block copies and swaps.

    On the CPU, 16-bit float pages (a bfloat16 cache) are scattered into as 16-bit integers: XLA's
    CPU backend runs a scatter over 16-bit floats in float32, converting the whole operand, a layer's
    page pool, there and back at every call. Through the bits it still copies the pool twice (a
    bitcast-convert is a loop there), which block copies and swaps, being rare, can afford."""
    if not _is_16_bit_float(pages):
        return _scatter(pages, at, values)

    def through_bits(pages, values):
        written = _bits(pages).at[at].set(_bits(values.astype(pages.dtype)), mode="drop")
        return jax.lax.bitcast_convert_type(written, pages.dtype)

    return jax.lax.platform_dependent(pages, values, cpu=through_bits, default=lambda p, v: _scatter(p, at, v))


def get_pages(pages: jax.Array, at) -> jax.Array:
    """pages[at], on the CPU without converting the whole pool first (see set_pages)."""
    if not _is_16_bit_float(pages):
        return pages[at]
    return jax.lax.platform_dependent(
        pages, cpu=lambda p: jax.lax.bitcast_convert_type(_bits(p)[at], p.dtype), default=lambda p: p[at])


def _is_16_bit_float(pages: jax.Array) -> bool:
    return jnp.issubdtype(pages.dtype, jnp.floating) and pages.dtype.itemsize == 2


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def tokens_first(pages: jax.Array, layout: str) -> jax.Array:
    """Gathered pages [..., n, <page in layout>] as contiguous K or V [..., n * block_size, kv_heads, dim]."""
    x = jnp.moveaxis(pages, _axis(layout, "slot") - 4, -3)  # [..., n, block_size, kv_heads, dim]
    return x.reshape(*x.shape[:-4], x.shape[-4] * x.shape[-3], *x.shape[-2:])


def heads_first(pages: jax.Array, layout: str) -> jax.Array:
    """Gathered pages [..., n, <page in layout>] as contiguous K or V [..., kv_heads, n * block_size, dim]."""
    x = jnp.moveaxis(pages, _axis(layout, "head") - 4, -4)  # [..., kv_heads, n, block_size, dim]
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def gather_kv(pages: jax.Array, block_tables: jax.Array, layout: str = TOKEN_MAJOR) -> jax.Array:
    """Contiguous per-sequence K or V read through the block tables.

    pages: one layer's pages in `layout`
    block_tables: int32 [num_seqs, max_blocks_per_seq]
    returns [num_seqs, max_blocks_per_seq * block_size, num_kv_heads, head_dim]
    """
    return tokens_first(pages[block_tables], layout)


def convert(pages: jax.Array, src: str, dst: str) -> jax.Array:
    """Pages in layout `src` as pages in layout `dst` (a transposed copy)."""
    return jnp.transpose(pages, index(dst, 0, _axis(src, "slot"), _axis(src, "head"), 3))


def to_jax_layout(pages: jax.Array, layout: str) -> jax.Array:
    """Pages in `layout` as JAX's Pallas paged attention reads them: [kv_heads, num_blocks, block_size, dim]."""
    return jnp.moveaxis(convert(pages, layout, HEAD_MAJOR), 1, 0)
