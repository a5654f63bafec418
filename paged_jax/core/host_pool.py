"""The block pool's operations in NumPy, for host loops that make tens of thousands of them.

block_pool.py is the pool: pure jitted functions over a pytree of JAX arrays, which the engine runs and
a researcher jits and vmaps. Called one at a time from Python, each is a dispatch, a transfer of its
ids and a read-back: tens of microseconds. A replay (replay.py) runs no model, only the scheduler, and
makes tens of thousands of pool calls, so there these stand in: the same functions with the same
arguments and results, on a BlockPool of NumPy arrays (head and num_free plain ints), a few
microseconds each. Like the originals they never modify the pool passed in, and on failure they return
it. tests/core/test_host_pool.py applies random operation sequences, failing ones included, to both
implementations and checks equal pools, ids, copies and ok flags after every call.
"""

import dataclasses

import numpy as np

from paged_jax.core.block_pool import NULL_BLOCK, BlockPool


def init_pool(num_blocks: int) -> BlockPool:
    """A pool with every block but NULL_BLOCK free."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be at least 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
    return BlockPool(free_queue=np.arange(1, num_blocks, dtype=np.int32), head=0, num_free=num_blocks - 1,
                     refcounts=np.zeros(num_blocks, np.int32))


def allocate(pool: BlockPool, n: int, max_n: int) -> tuple[BlockPool, np.ndarray, bool]:
    """block_pool.allocate: n fresh blocks; ids int32 [max_n], -1 from position n on."""
    ids = np.full(max_n, -1, np.int32)
    if not 0 <= n <= min(max_n, pool.num_free):
        return pool, ids, False
    pool, taken = _pop(pool, n)
    ids[:n] = taken
    return pool, ids, True


def free(pool: BlockPool, ids) -> tuple[BlockPool, bool]:
    """block_pool.free: drop one reference per entry of ids (int32 [k], negative entries padding);
    released blocks join the free queue lowest id first."""
    counts, ok = _counts(pool, ids)
    if not ok or (counts > pool.refcounts).any():
        return pool, False
    refcounts = pool.refcounts - counts
    released = np.flatnonzero((pool.refcounts > 0) & (refcounts == 0))
    queue = pool.free_queue.copy()
    queue[(pool.head + pool.num_free + np.arange(released.size)) % queue.size] = released
    return BlockPool(free_queue=queue, head=pool.head, num_free=pool.num_free + released.size,
                     refcounts=refcounts), True


def share(pool: BlockPool, ids) -> tuple[BlockPool, bool]:
    """block_pool.share: add one reference per entry of ids (int32 [k], negative entries padding)."""
    counts, ok = _counts(pool, ids)
    if not ok or ((counts > 0) & (pool.refcounts == 0)).any():
        return pool, False
    return dataclasses.replace(pool, refcounts=pool.refcounts + counts), True


def copy_on_write(pool: BlockPool, ids) -> tuple[BlockPool, np.ndarray, np.ndarray, bool]:
    """block_pool.copy_on_write: entries of a block are served in order and the one holding its last
    reference keeps the original; returns (pool, new_ids int32 [k], copies int32 [k, 2], ok)."""
    ids = np.asarray(ids, np.int32)
    failed = pool, ids, np.full((ids.size, 2), -1, np.int32), False
    counts, ok = _counts(pool, ids)
    if not ok or (counts > pool.refcounts).any():
        return failed
    seen = {}
    copy = np.zeros(ids.size, bool)
    for i, block in enumerate(ids.tolist()):
        if block >= 0:
            copy[i] = seen.get(block, 0) < pool.refcounts[block] - 1
            seen[block] = seen.get(block, 0) + 1
    if copy.sum() > pool.num_free:
        return failed
    pool, dst = _pop(pool, int(copy.sum()))
    refcounts = pool.refcounts - np.bincount(ids[copy], minlength=pool.num_blocks).astype(np.int32)
    new_ids, copies = ids.copy(), np.full((ids.size, 2), -1, np.int32)
    new_ids[copy] = dst
    copies[copy] = np.stack([ids[copy], dst], axis=-1)
    return dataclasses.replace(pool, refcounts=refcounts), new_ids, copies, True


def _counts(pool: BlockPool, ids) -> tuple[np.ndarray, bool]:
    """(int32 [num_blocks]: how often each block appears in ids, whether every non-negative id is a
    real block)."""
    ids = np.asarray(ids)
    real = (ids > NULL_BLOCK) & (ids < pool.num_blocks)
    ok = bool((real | (ids < 0)).all())
    return np.bincount(ids[real], minlength=pool.num_blocks).astype(np.int32), ok


def _pop(pool: BlockPool, n: int) -> tuple[BlockPool, np.ndarray]:
    """Hand out the n blocks at the head of the free queue (n <= num_free), each with one reference."""
    size = pool.free_queue.size
    ids = pool.free_queue[(pool.head + np.arange(n)) % size]
    refcounts = pool.refcounts.copy()
    refcounts[ids] = 1
    return BlockPool(free_queue=pool.free_queue, head=(pool.head + n) % size, num_free=pool.num_free - n,
                     refcounts=refcounts), ids
