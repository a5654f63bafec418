"""Page tables: which physical block holds each logical block of each sequence.

A sequence holding L tokens owns exactly ceil(L / block_size) blocks, listed in order in its row of
the block table; the rest of the row is NULL_BLOCK. Token at position p lives in logical block
p // block_size at offset p % block_size, so in physical slot block * block_size + offset, the slot
`kernels_pallas.layout.write_kv` scatters to.

Like the block pool, every operation is a pure jitted function with static shapes and an `ok` flag;
when it is False the page table and the pool come back unchanged. Sequence ids are rows of the
table; a negative id is padding.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import cdiv

from paged_jax.core import block_pool
from paged_jax.core.block_pool import NULL_BLOCK, BlockPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """The rows of up to max_seqs sequences; under vmap each array gains a leading batch axis."""

    block_tables: jax.Array  # int32 [max_seqs, max_blocks_per_seq]; NULL_BLOCK past a sequence's blocks
    lengths: jax.Array  # int32 [max_seqs]; tokens held, 0 for an unused row
    block_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[-2]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[-1]


def init_page_table(max_seqs: int, max_blocks_per_seq: int, block_size: int) -> PageTable:
    """Every row empty."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return PageTable(
        block_tables=jnp.full((max_seqs, max_blocks_per_seq), NULL_BLOCK, jnp.int32),
        lengths=jnp.zeros(max_seqs, jnp.int32),
        block_size=block_size,
    )


def position_to_block(position, block_size: int):
    """Token position (int or int32 array) -> (logical block, offset in it), e.g. 37, 16 -> (2, 5)."""
    return position // block_size, position % block_size


def blocks_for_tokens(num_tokens, block_size: int):
    """Blocks that num_tokens tokens (int or int32 array) occupy: ceil(num_tokens / block_size)."""
    return cdiv(num_tokens, block_size)


@jax.jit
def slot_mapping(page_table: PageTable, seq_ids: jax.Array, positions: jax.Array) -> jax.Array:
    """Physical slot of each new token, the `slot_mapping` of `kernels_pallas.layout.write_kv`.

    seq_ids: int32 [num_tokens]; the row of each token's sequence.
    positions: int32 [num_tokens]; each token's position in its sequence, inside the blocks the
        sequence owns (append_tokens first). A position past the row maps into NULL_BLOCK, never
        into another sequence's block.
    returns int32 [num_tokens]; -1 for padding (a negative seq id or position).
    """
    block, offset = position_to_block(positions, page_table.block_size)
    padding = (seq_ids < 0) | (positions < 0)
    rows = jnp.where(padding, page_table.max_seqs, seq_ids)
    physical = page_table.block_tables.at[rows, block].get(mode="fill", fill_value=NULL_BLOCK)
    return jnp.where(padding, -1, physical * page_table.block_size + offset)


@functools.partial(jax.jit, static_argnames="max_new_blocks")
def append_tokens(
    page_table: PageTable,
    pool: BlockPool,
    seq_ids: jax.Array,
    num_new_tokens: jax.Array,
    *,
    max_new_blocks: int | None = None,
) -> tuple[PageTable, BlockPool, jax.Array]:
    """Grow sequences by some tokens, taking a block from the pool for each block boundary crossed.

    seq_ids: int32 [k]; distinct rows, negative entries padding.
    num_new_tokens: int32 [k]; tokens appended to each (>= 0).
    max_new_blocks: static bound on the blocks this call may take (the length of the allocation);
        the default, k * max_blocks_per_seq, always suffices. A decode step can pass k.
    Fails (ok False, nothing changed) when a row is out of range or repeated, a count is negative,
    a sequence would outgrow its row, the blocks needed exceed max_new_blocks, or the pool runs out.
    Blocks are not unshared: call unshare_last_blocks first if a sequence's last block may be shared.
    returns (page_table, pool, ok bool []).
    """
    k = seq_ids.shape[0]
    if max_new_blocks is None:
        max_new_blocks = k * page_table.max_blocks_per_seq
    rows, ok = _check_rows(page_table, seq_ids)
    new_tokens = jnp.where(seq_ids >= 0, num_new_tokens, 0)
    old_lengths = page_table.lengths.at[rows].get(mode="fill", fill_value=0)
    new_lengths = old_lengths + new_tokens
    old_blocks = blocks_for_tokens(old_lengths, page_table.block_size)
    new_blocks = blocks_for_tokens(new_lengths, page_table.block_size)
    ok &= jnp.all(new_tokens >= 0) & jnp.all(new_blocks <= page_table.max_blocks_per_seq)
    needed = new_blocks - old_blocks
    pool, ids, allocated = block_pool.allocate(pool, jnp.where(ok, jnp.sum(needed), 0), max_new_blocks)
    ok &= allocated

    # ids are laid out sequence after sequence: id j belongs to the first entry whose running total
    # of needed blocks exceeds j, and extends that sequence's blocks in order.
    ends = jnp.cumsum(needed)
    j = jnp.arange(max_new_blocks)
    owner = jnp.minimum(jnp.searchsorted(ends, j, side="right"), k - 1)
    logical = old_blocks[owner] + j - (ends - needed)[owner]
    target = jnp.where(ok & (ids >= 0), rows[owner], page_table.max_seqs)
    block_tables = page_table.block_tables.at[target, logical].set(ids, mode="drop")
    lengths = page_table.lengths.at[jnp.where(ok, rows, page_table.max_seqs)].set(new_lengths, mode="drop")
    return dataclasses.replace(page_table, block_tables=block_tables, lengths=lengths), pool, ok


@jax.jit
def release(page_table: PageTable, pool: BlockPool, seq_ids: jax.Array) -> tuple[PageTable, BlockPool, jax.Array]:
    """Empty sequences' rows and drop their references to their blocks.

    seq_ids: int32 [k]; distinct rows, negative entries padding.
    returns (page_table, pool, ok bool []).
    """
    rows, ok = _check_rows(page_table, seq_ids)
    owned = _owned_blocks(page_table, rows)
    pool, freed = block_pool.free(pool, jnp.where(ok, owned, -1).reshape(-1))
    return _set_rows(page_table, jnp.where(ok & freed, rows, page_table.max_seqs), NULL_BLOCK, 0), pool, ok & freed


@jax.jit
def fork(
    page_table: PageTable, pool: BlockPool, src: jax.Array, seq_ids: jax.Array
) -> tuple[PageTable, BlockPool, jax.Array]:
    """Start sequences as copies of sequence src that share its blocks (a common prompt, a beam).

    src: int32 []; the row to copy.
    seq_ids: int32 [k]; distinct empty rows other than src, negative entries padding.
    returns (page_table, pool, ok bool []).
    """
    rows, ok = _check_rows(page_table, seq_ids)
    ok &= (src >= 0) & (src < page_table.max_seqs) & jnp.all(seq_ids != src)
    ok &= jnp.all(page_table.lengths.at[rows].get(mode="fill", fill_value=0) == 0)
    src_blocks = _owned_blocks(page_table, src[None])  # [1, max_blocks_per_seq]
    refs = jnp.where(ok & (rows < page_table.max_seqs)[:, None], src_blocks, -1)
    pool, shared = block_pool.share(pool, refs.reshape(-1))
    target = jnp.where(ok & shared, rows, page_table.max_seqs)
    return _set_rows(page_table, target, page_table.block_tables[src], page_table.lengths[src]), pool, ok & shared


@jax.jit
def unshare_last_blocks(
    page_table: PageTable, pool: BlockPool, seq_ids: jax.Array
) -> tuple[PageTable, BlockPool, jax.Array, jax.Array]:
    """Give each sequence a private copy of its last block if it is shared and partly filled.

    KV is append-only, so the partly filled last block is the only one the next token writes to; a
    full block stays shared and the next token starts a new one.
    seq_ids: int32 [k]; distinct rows, negative entries padding.
    returns (page_table, pool, copies int32 [k, 2] of (src, dst) blocks whose K/V the caller must
        copy before writing, (-1, -1) where nothing is copied, ok bool []).
    """
    rows, ok = _check_rows(page_table, seq_ids)
    lengths = page_table.lengths.at[rows].get(mode="fill", fill_value=0)
    last = blocks_for_tokens(lengths, page_table.block_size) - 1
    partial = ok & (lengths % page_table.block_size != 0)
    ids = jnp.where(partial, page_table.block_tables.at[rows, last].get(mode="fill", fill_value=-1), -1)
    pool, new_ids, copies, copied = block_pool.copy_on_write(pool, ids)
    target = jnp.where(partial & copied, rows, page_table.max_seqs)
    block_tables = page_table.block_tables.at[target, last].set(new_ids, mode="drop")
    return dataclasses.replace(page_table, block_tables=block_tables), pool, copies, ok & copied


def _check_rows(page_table: PageTable, seq_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """seq_ids int32 [k] -> (rows with padding moved out of bounds, whether the others are distinct rows)."""
    in_range = (seq_ids >= 0) & (seq_ids < page_table.max_seqs)
    # Out of bounds rather than negative: JAX wraps negative indices before mode="drop" sees them.
    rows = jnp.where(in_range, seq_ids, page_table.max_seqs)
    counts = jnp.zeros_like(page_table.lengths).at[rows].add(1, mode="drop")
    return rows, jnp.all(in_range | (seq_ids < 0)) & jnp.all(counts <= 1)


def _owned_blocks(page_table: PageTable, rows: jax.Array) -> jax.Array:
    """int32 [k, max_blocks_per_seq]: the blocks rows (int32 [k], out of bounds = none) own, -1 past them."""
    lengths = page_table.lengths.at[rows].get(mode="fill", fill_value=0)
    owned = jnp.arange(page_table.max_blocks_per_seq) < blocks_for_tokens(lengths, page_table.block_size)[:, None]
    return jnp.where(owned, page_table.block_tables.at[rows].get(mode="fill", fill_value=-1), -1)


def _set_rows(page_table: PageTable, rows: jax.Array, block_row, length) -> PageTable:
    """Set rows (int32 [k], out of bounds skipped) to one block-table row and length."""
    return PageTable(
        block_tables=page_table.block_tables.at[rows].set(block_row, mode="drop"),
        lengths=page_table.lengths.at[rows].set(length, mode="drop"),
        block_size=page_table.block_size,
    )
