"""Whole KV blocks moved in every layer at once: copied (copy-on-write of a shared block), read to the
host and written back (swap preemption), and every page written once (before traffic). Each is one
jitted call with the cache donated where it changes, so XLA updates the pages in place.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kernels_pallas import KVCache
from kernels_pallas.layout import get_pages, set_pages


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def copy_blocks(kv_cache: KVCache, copies: jax.Array, num_copies: jax.Array) -> KVCache:
    """Copy whole blocks src -> dst in every layer, for the first num_copies (int32 []) rows (src, dst)
    of copies: int32 [n, 2], one after another. The block axis comes first in every layout, so this
    copies whole blocks in any."""
    def one(i, cache: KVCache) -> KVCache:
        src, dst = copies[i, 0], copies[i, 1]
        # As 16-bit integers for bfloat16 pages (layout.py): XLA's CPU backend would convert the pool.
        copy = lambda pages: set_pages(pages, dst[None], get_pages(pages, src[None]))
        return dataclasses.replace(cache, k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)))
    return jax.lax.fori_loop(0, num_copies, one, kv_cache)


@functools.partial(jax.jit, donate_argnames=("kv_cache",), keep_unused=True)
def write_every_page(kv_cache: KVCache) -> KVCache:
    """Zeros into every page, in place. A pool allocated unwritten (kernels_pallas.allocate_pages) is
    mapped by the OS block by block as steps first write it, at a fault per 4 kB page (about 5 us on the
    2-core VMs, some 15 ms of a 277-token prompt's first step); written once before traffic, it is not.
    keep_unused: the pages are not read, and an argument jit prunes is neither donated (the pool would be
    held twice) nor what makes the result committed to the pages' device (an uncommitted cache is
    another program of every step)."""
    zeros = lambda pages: tuple(jnp.zeros_like(p) for p in pages)
    return dataclasses.replace(kv_cache, k=zeros(kv_cache.k), v=zeros(kv_cache.v))


@jax.jit
def read_blocks(kv_cache: KVCache, ids: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    return [get_pages(k, ids) for k in kv_cache.k], [get_pages(v, ids) for v in kv_cache.v]


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def write_blocks(kv_cache: KVCache, ids: jax.Array, k: tuple, v: tuple) -> KVCache:
    """ids: int32 [n], out of range = skip; k[l], v[l]: layer l's blocks [n, ...] in the cache's layout
    (as swap_out read them)."""
    put = lambda pages, new: set_pages(pages, ids, new)
    return dataclasses.replace(kv_cache, k=tuple(map(put, kv_cache.k, k)), v=tuple(map(put, kv_cache.v, v)))
