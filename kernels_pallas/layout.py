"""The paged KV cache layout: the one place that knows how pages are laid out in memory.

Per layer, K and V each live in an array

    pages: [num_blocks, block_size, num_kv_heads, head_dim]

("token-major" pages, as vLLM's flash-attention backend keeps them). Why this layout:

- Writing a new token is one contiguous row of num_kv_heads * head_dim values, so the scatter of a
  step's new K/V through the slot mapping (slot = block * block_size + offset) touches one cache
  line run per token. The write happens every step for every token; reads are batched.
- Gathering a sequence's pages through its block table yields [blocks, block_size, kv_heads, dim],
  which reshapes for free into contiguous [tokens, kv_heads, dim] K/V: the CPU path attends over it
  with plain einsums.
- The GPU kernel reads one (block, kv_head) tile as block_size rows of head_dim with a stride of
  num_kv_heads * head_dim: strided but fully coalesced within a row.

JAX's own Pallas paged attention uses head-major pages [num_kv_heads, num_blocks, block_size, dim];
`to_head_major` converts for comparisons against it. Researchers comparing layouts change this file.
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's pages; a pytree to donate to the jitted step so it is updated in place.

    k[i], v[i]: [num_blocks, block_size, num_kv_heads, head_dim] for layer i (one array per layer, so
    a layer's read and write never slice a larger buffer).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


def init_kv_cache(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
    *, allocate=jnp.zeros,
) -> KVCache:
    """Every layer's pages, each made by allocate(shape, dtype): zeros unless told otherwise."""
    shape = page_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return KVCache(
        k=tuple(allocate(shape, dtype) for _ in range(num_layers)),
        v=tuple(allocate(shape, dtype) for _ in range(num_layers)),
    )


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """KV bytes one block holds across all layers (K and V)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def page_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) pages."""
    return (num_blocks, block_size, num_kv_heads, head_dim)


def write_kv(
    k_pages: jax.Array, v_pages: jax.Array, slot_mapping: jax.Array, k: jax.Array, v: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter a step's new K/V into the pages.

    k_pages, v_pages: [num_blocks, block_size, num_kv_heads, head_dim] (donate them to the caller's
        jit so the update happens in place).
    slot_mapping: int32 [num_tokens]; physical slot block * block_size + offset, negative for
        padding tokens, which are not written.
    k, v: [num_tokens, num_kv_heads, head_dim], cast to the pages' dtype.
    """
    num_blocks, block_size, kvh, dim = k_pages.shape
    num_slots = num_blocks * block_size
    # Padding goes out of bounds and mode="drop" discards it (negative indices would wrap).
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    k_flat = k_pages.reshape(num_slots, kvh, dim).at[slots].set(k.astype(k_pages.dtype), mode="drop")
    v_flat = v_pages.reshape(num_slots, kvh, dim).at[slots].set(v.astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)


def gather_kv(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Contiguous per-sequence K or V read through the block tables.

    pages: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: int32 [num_seqs, max_blocks_per_seq]
    returns [num_seqs, max_blocks_per_seq * block_size, num_kv_heads, head_dim]
    """
    num_seqs, max_blocks = block_tables.shape
    _, block_size, kvh, dim = pages.shape
    return pages[block_tables].reshape(num_seqs, max_blocks * block_size, kvh, dim)


def to_head_major(pages: jax.Array) -> jax.Array:
    """[num_blocks, block_size, kv_heads, dim] -> [kv_heads, num_blocks, block_size, dim]."""
    return jnp.transpose(pages, (2, 0, 1, 3))
