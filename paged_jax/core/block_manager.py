"""The engine's hold on the functional block pool, with the prefix cache beside it.

The pool state is the same pytree of JAX arrays a researcher jits and vmaps (block_pool.py); the engine
keeps it on the host's CPU device, whatever accelerator the model runs on, because every scheduling
decision is made on the host and reading it back there is a memcpy. Each method is a jitted pool call
(or a few, for more than POOL_IDS ids), with id lists padded to POOL_IDS, so each call has one program,
which `warm_up` makes before traffic.

A call reads back only its scalars (ok, the free count) and the ids it hands out. The reference
counts the scheduler consults are a host copy kept in step with each successful call by the call's
own rule (+1 per id shared, -1 per id freed, 1 for each id handed out), so no call moves a
[num_blocks] array to the host: a GPU's pool has over 100,000 blocks (tests compare the copy with the
pool after every operation).

A replay, which runs the scheduler without a model, asks for the pool's NumPy twin (host_pool.py,
tested against the jitted pool): the same decisions without a dispatch per call.
"""

import types

import jax
import numpy as np

from paged_jax.core import block_pool, host_pool
from paged_jax.core.buckets import POOL_IDS, pad_ids
from paged_jax.core.prefix_cache import PrefixCache, block_hashes


# The pool's operations with the pool donated: the manager holds one pool and replaces it with each
# call's result, so XLA updates it in place instead of copying its [num_blocks] arrays every call.
_DONATED = types.SimpleNamespace(
    allocate=jax.jit(block_pool.allocate, static_argnames="max_n", donate_argnames="pool"),
    **{op.__name__: jax.jit(op, donate_argnames="pool")
       for op in (block_pool.free, block_pool.share, block_pool.copy_on_write)})


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 numpy_pool: bool = False):
        """numpy_pool: run the pool's operations in NumPy (host_pool.py) rather than as jitted calls."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ops = host_pool if numpy_pool else _DONATED
        if numpy_pool:
            self._cpu = None
            self.pool = host_pool.init_pool(num_blocks)
        else:
            self._cpu = jax.local_devices(backend="cpu")[0]  # this process's, in a group of processes
            with jax.default_device(self._cpu):
                # Committed, as every pool a call returns is: a program is made for each, so the
                # first pool's calls would otherwise need programs of their own.
                self.pool = jax.device_put(block_pool.init_pool(num_blocks), self._cpu)
        self.cache = PrefixCache(num_blocks) if enable_prefix_caching else None
        self.refcounts = np.array(self.pool.refcounts, np.int32)  # the host copy: see the module's docstring
        self.num_free = int(self.pool.num_free)

    def _padded_ids(self, ids: list[int]) -> jax.Array | np.ndarray:
        padded = pad_ids(ids, POOL_IDS, -1)
        return padded if self._cpu is None else jax.device_put(padded, self._cpu)

    def warm_up(self) -> None:
        """Make each pool call's program, by calls that change nothing."""
        none = self._padded_ids([])
        self.pool = self._ops.allocate(self.pool, 0, max_n=POOL_IDS)[0]
        for op in (self._ops.free, self._ops.share, self._ops.copy_on_write):
            self.pool = op(self.pool, none)[0]

    def can_allocate(self, n: int, keep: list[int] = ()) -> bool:
        """Whether n blocks can be had, evicting cached blocks (other than `keep`) if need be."""
        if n <= self.num_free:
            return True
        if self.cache is None:
            return False
        return n <= self.num_free + self.cache.num_evictable(self.refcounts, keep)

    def allocate(self, n: int) -> list[int]:
        if n == 0:
            return []
        if n > self.num_free and self.cache is not None:
            self.free(self.cache.evict(self.refcounts, n - self.num_free))
        if n > self.num_free:  # checked before the first call, so a failure leaves the pool as it was
            raise RuntimeError(f"block pool refused to allocate {n} blocks ({self.num_free} free)")
        out = []
        for start in range(0, n, POOL_IDS):
            take = min(POOL_IDS, n - start)
            self.pool, ids, ok = self._ops.allocate(self.pool, take, max_n=POOL_IDS)
            ids = self._check(ok, f"allocate {take} (of {self.num_free} free)", [], ids)[:take]
            self.refcounts[ids] = 1
            out += ids.tolist()
        return out

    def free(self, ids: list[int]) -> None:
        for start in range(0, len(ids), POOL_IDS):
            chunk = ids[start : start + POOL_IDS]
            self.pool, ok = self._ops.free(self.pool, self._padded_ids(chunk))
            self._check(ok, "free", chunk)
            np.subtract.at(self.refcounts, chunk, 1)

    def share(self, ids: list[int]) -> None:
        for start in range(0, len(ids), POOL_IDS):
            chunk = ids[start : start + POOL_IDS]
            self.pool, ok = self._ops.share(self.pool, self._padded_ids(chunk))
            self._check(ok, "share", chunk)
            np.add.at(self.refcounts, chunk, 1)

    def _check(self, ok: jax.Array | bool, what: str, ids, result=None) -> np.ndarray | None:
        """Raise unless the call succeeded; update the free count. Returns result (an array the call
        returned) on the host, read back with ok and the count in one transfer."""
        ok, num_free, result = jax.device_get((ok, self.pool.num_free, result))
        if not bool(ok):
            # The scheduler's bookkeeping disagrees with the pool: a bug, never a user error.
            raise RuntimeError(f"block pool refused to {what} blocks {list(ids)}")
        self.num_free = int(num_free)
        return result

    def is_shared(self, block: int) -> bool:
        """Whether a write to block must go to a private copy first."""
        return self.refcounts[block] > 1

    def copy_on_write(self, block: int) -> tuple[int, int]:
        """(block, its private copy) for a shared block about to be written; the copy is one fresh
        block, so the caller checks can_allocate(1) first."""
        if self.num_free == 0 and self.cache is not None:
            self.free(self.cache.evict(self.refcounts, 1))
        self.pool, _, copies, ok = self._ops.copy_on_write(self.pool, self._padded_ids([block]))
        src, dst = (int(x) for x in self._check(ok, "copy on write", [block], copies)[0])
        if src >= 0:  # (-1, -1): the block was not shared after all, and nothing changed
            self.refcounts[src] -= 1
            self.refcounts[dst] = 1
        return src, dst

    # Prefix caching.

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks of the longest prefix of token_ids, leaving at least one token to compute
        (its logits are needed). The caller shares them once admission is certain."""
        if self.cache is None:
            return []
        return self.cache.match(block_hashes(token_ids[:-1], self.block_size))

    def cache_full_blocks(self, token_ids: list[int], block_ids: list[int], num_cached: int, num_computed: int) -> int:
        """Name the blocks that became full and computed; returns the new count of named blocks."""
        full = num_computed // self.block_size
        if self.cache is None or full <= num_cached:
            return num_cached
        hashes = block_hashes(token_ids[: full * self.block_size], self.block_size)
        newly_held = [b for h, b in zip(hashes[num_cached:], block_ids[num_cached:full]) if self.cache.insert(h, b)]
        self.share(newly_held)
        return full

    def reset_prefix_cache(self) -> None:
        """Drop every cached block: afterwards a pool with no running sequence is all free."""
        if self.cache is not None:
            self.free(self.cache.clear())

    @property
    def num_evictable(self) -> int:
        return 0 if self.cache is None else self.cache.num_evictable(self.refcounts)
