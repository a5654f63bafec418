"""The block pool: which physical KV blocks are free, and how many references each one has.

The state is a pytree of JAX arrays and every operation is a pure, jitted `pool -> pool` function
with static shapes, so it runs under `jax.jit` and `jax.vmap` and, called from a Python host loop,
costs one cached dispatch (keep the pool on the CPU device: the jitted functions run where their
arguments live). Variable counts travel as masks over padded id vectors: a negative id is padding.

Every operation returns an `ok` flag; when it is False the returned pool is the pool passed in, so a
failed request (out of blocks, a double free, sharing a free block) never hands out a wrong or
duplicated id and never drives a reference count negative.

Block `NULL_BLOCK` (0) is reserved and never handed out: page tables point their unused entries at
it, so a gather through a padded block table reads a page no sequence ever writes.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

NULL_BLOCK = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockPool:
    """Free blocks and reference counts of `num_blocks` physical blocks (block 0 reserved).

    Under vmap each field gains a leading batch axis.
    """

    # A ring buffer, popped at `head` and pushed at `head + num_free`: first freed, first reused.
    # Blocks kept for prefix caching never enter it: the host's prefix cache (prefix_cache.py) names
    # them by a hash of their tokens and holds a reference of its own on each, until it evicts them,
    # least recently used first.
    free_queue: jax.Array  # int32 [num_blocks - 1]; free ids at head .. head + num_free - 1 (mod size)
    head: jax.Array  # int32 []
    num_free: jax.Array  # int32 []
    refcounts: jax.Array  # int32 [num_blocks]; 0 for free blocks and for NULL_BLOCK

    @property
    def num_blocks(self) -> int:
        return self.refcounts.shape[-1]

    @property
    def capacity(self) -> int:
        """Blocks that can be handed out: all but NULL_BLOCK."""
        return self.free_queue.shape[-1]


def init_pool(num_blocks: int) -> BlockPool:
    """A pool with every block but NULL_BLOCK free."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be at least 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
    return BlockPool(
        free_queue=jnp.arange(1, num_blocks, dtype=jnp.int32),
        head=jnp.zeros((), jnp.int32),
        num_free=jnp.array(num_blocks - 1, jnp.int32),
        refcounts=jnp.zeros(num_blocks, jnp.int32),
    )


def num_in_use(pool: BlockPool) -> jax.Array:
    """int32 []: blocks with at least one reference (shared blocks count once)."""
    return jnp.sum(pool.refcounts > 0, axis=-1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames="max_n")
def allocate(pool: BlockPool, n: jax.Array, max_n: int) -> tuple[BlockPool, jax.Array, jax.Array]:
    """Take n free blocks, each with one reference.

    n: int32 []; the request fails (ok False, pool unchanged, no ids) unless 0 <= n <= min(max_n, num_free).
    max_n: static length of the returned ids.
    returns (pool, ids int32 [max_n] with -1 from position n on, ok bool []).
    """
    ok = (n >= 0) & (n <= max_n) & (n <= pool.num_free)
    pool, ids = _pop(pool, jnp.arange(max_n) < jnp.where(ok, n, 0))
    return pool, ids, ok


@jax.jit
def free(pool: BlockPool, ids: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Drop one reference per entry of ids; blocks left with none go back to the free queue.

    ids: int32 [k]; negative entries are padding. A block may appear several times (one entry per
        reference dropped). Fails (ok False, pool unchanged) on an id that is not a real block or
        on more entries for a block than it has references.
    returns (pool, ok bool []).
    """
    index, ok = _check_ids(pool, ids)
    refs, occurrence = _refs(pool, index), _occurrence(ids)
    # Entry number c (from 0) of a block drops its reference c + 1: at most the block's count.
    ok &= jnp.all((index == pool.num_blocks) | (occurrence < refs))
    refcounts = pool.refcounts.at[jnp.where(ok, index, pool.num_blocks)].add(-1, mode="drop")
    # The entry that drops a block's last reference releases it: one entry per released block.
    released = ok & (index < pool.num_blocks) & (occurrence == refs - 1)
    return _push(dataclasses.replace(pool, refcounts=refcounts), jnp.where(released, ids, -1)), ok


@jax.jit
def share(pool: BlockPool, ids: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Add one reference per entry of ids (a fork, or a prefix another sequence already holds).

    ids: int32 [k]; negative entries are padding. Fails (ok False, pool unchanged) on an id that is
        not a real block or is free: a free block may be handed out again at any time.
    returns (pool, ok bool []).
    """
    index, ok = _check_ids(pool, ids)
    ok &= jnp.all((index == pool.num_blocks) | (_refs(pool, index) > 0))
    return dataclasses.replace(pool, refcounts=pool.refcounts.at[jnp.where(ok, index, pool.num_blocks)].add(
        1, mode="drop")), ok


@jax.jit
def copy_on_write(pool: BlockPool, ids: jax.Array) -> tuple[BlockPool, jax.Array, jax.Array, jax.Array]:
    """Make each referenced block private to the caller before it is written.

    ids: int32 [k]; one entry per reference about to write, negative entries are padding. An entry
        whose block has other references gets a fresh block (one reference) and drops its reference
        to the original. Entries of the same block are served in order and the one holding the last
        reference keeps the original, so no block is copied only to be freed.
    Fails (ok False, pool unchanged, ids returned as given, no copies) on an id that is not a real
    block, on more entries for a block than it has references, or when too few blocks are free.
    returns (pool, new_ids int32 [k], copies int32 [k, 2] of (src, dst) blocks whose contents the
        caller must copy, (-1, -1) where nothing is copied, ok bool []).
    """
    index, ok = _check_ids(pool, ids)
    refs, occurrence = _refs(pool, index), _occurrence(ids)
    ok &= jnp.all((index == pool.num_blocks) | (occurrence < refs))
    copy = (index < pool.num_blocks) & (occurrence < refs - 1)
    ok &= jnp.sum(copy) <= pool.num_free
    copy &= ok
    pool, dst = _pop(pool, copy)
    refcounts = pool.refcounts.at[jnp.where(copy, index, pool.num_blocks)].add(-1, mode="drop")
    copies = jnp.stack([jnp.where(copy, ids, -1), dst], axis=-1)
    return dataclasses.replace(pool, refcounts=refcounts), jnp.where(copy, dst, ids), copies, ok


@jax.jit
def apply_log(pool: BlockPool, released: jax.Array, taken: jax.Array, touched: jax.Array,
              counts: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Replay a host's bookkeeping of the pool (block_manager.py) in one call: the blocks it released
    and took, then the reference counts it left.

    released: int32 [k] blocks that went back to the free queue, in the order they went, then -1s.
    taken: int32 [k] the blocks the host handed out, in the order it took them, then -1s. Both from
        one stretch of the host's operations, in whatever interleaving: the queue is a stream (its free
        blocks, then the released ones) whose first len(taken) blocks are taken, so a block taken
        and released, or released and taken again, within the stretch replays as it happened.
    touched, counts: int32 [k] blocks and their reference counts at the end; -1 padding.
    Fails (ok False, pool unchanged) where the host and the queue disagree: a taken block that is not
    the next one in the stream, or more taken than the stream holds.
    returns (pool, ok bool []).
    """
    size, width = pool.free_queue.shape[0], released.shape[0]
    num_released = jnp.sum(released >= 0, dtype=jnp.int32)
    take = taken >= 0
    num_taken = jnp.sum(take, dtype=jnp.int32)
    # Read before any write: a released block may land on a slot a taken one leaves.
    j = jnp.arange(taken.shape[0])
    from_released = released[jnp.clip(j - pool.num_free, 0, width - 1)]
    ids = jnp.where(j < pool.num_free, pool.free_queue[(pool.head + j) % size], from_released)
    ok = (num_taken <= pool.num_free + num_released) & jnp.all(jnp.where(take, ids, -1) == taken)
    # Writes aimed out of bounds on failure (dropped), so that nothing costs more than its k entries:
    # a select between two whole pools would pass over every block.
    ranks = jnp.arange(width)
    slots = jnp.where(ok & (ranks < num_released), (pool.head + pool.num_free + ranks) % size, size)
    refcounts = pool.refcounts.at[jnp.where(ok & take, taken, pool.num_blocks)].set(1, mode="drop")
    refcounts = refcounts.at[jnp.where(ok & (touched >= 0), touched, pool.num_blocks)].set(counts, mode="drop")
    return BlockPool(free_queue=pool.free_queue.at[slots].set(released, mode="drop"),
                     head=jnp.where(ok, (pool.head + num_taken) % size, pool.head),
                     num_free=jnp.where(ok, pool.num_free + num_released - num_taken, pool.num_free),
                     refcounts=refcounts), ok


def _check_ids(pool: BlockPool, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """ids int32 [k] -> (the ids with padding moved out of bounds, whether all others are real blocks)."""
    real = (ids > NULL_BLOCK) & (ids < pool.num_blocks)
    # Out of bounds rather than negative: JAX wraps negative indices before mode="drop" sees them.
    return jnp.where(real, ids, pool.num_blocks), jnp.all(real | (ids < 0))


def _refs(pool: BlockPool, index: jax.Array) -> jax.Array:
    """int32 [k]: the reference count of each block of index (int32 [k]), 0 where out of bounds.

    The operations touch only their k entries, never a [num_blocks] temporary: a GPU's pool has over
    100,000 blocks, and whole-pool passes made each call cost up to a millisecond on the host."""
    return pool.refcounts.at[index].get(mode="fill", fill_value=0)


def _occurrence(ids: jax.Array) -> jax.Array:
    """int32 [k]: how many earlier entries of ids (int32 [k]) hold the same value."""
    order = jnp.argsort(ids, stable=True)
    ranks = jnp.arange(ids.shape[0])
    sorted_ids = ids[order]
    run_start = jnp.where((ranks == 0) | (sorted_ids != jnp.roll(sorted_ids, 1)), ranks, 0)
    return jnp.zeros_like(ids).at[order].set(ranks - jax.lax.cummax(run_start))


def _pop(pool: BlockPool, take: jax.Array) -> tuple[BlockPool, jax.Array]:
    """Hand out one block, with one reference, per True entry of take (bool [k], at most num_free).

    returns (pool, ids int32 [k], -1 where take is False).
    """
    size = pool.free_queue.shape[0]
    ranks = jnp.cumsum(take) - 1
    ids = jnp.where(take, pool.free_queue[(pool.head + ranks) % size], -1)
    taken = jnp.sum(take, dtype=jnp.int32)
    return BlockPool(
        free_queue=pool.free_queue,
        head=(pool.head + taken) % size,
        num_free=pool.num_free - taken,
        refcounts=pool.refcounts.at[jnp.where(take, ids, pool.num_blocks)].set(1, mode="drop"),
    ), ids


def _push(pool: BlockPool, released: jax.Array) -> BlockPool:
    """Append the blocks of released (int32 [k]: distinct ids, -1 for none) to the free queue, lowest id
    first."""
    size = pool.free_queue.shape[0]
    ordered = jnp.sort(jnp.where(released >= 0, released, pool.num_blocks))  # the -1s last
    count = jnp.sum(released >= 0, dtype=jnp.int32)
    ranks = jnp.arange(released.shape[0])
    slots = jnp.where(ranks < count, (pool.head + pool.num_free + ranks) % size, size)
    return dataclasses.replace(pool, free_queue=pool.free_queue.at[slots].set(ordered, mode="drop"),
                               num_free=pool.num_free + count)
