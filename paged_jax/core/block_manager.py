"""The engine's hold on the block pool, with the prefix cache beside it.

Every scheduling decision is made on the host, and a step makes dozens of pool operations (a block
for each sequence that crosses into a new one, a reference for each block the prefix cache names).
Made as jitted pool calls, each was a dispatch and a read-back: a GPU step's scheduling took 3 ms, half
of it in those read-backs (docs/gpu.md). So the manager keeps the pool's bookkeeping on the host, by
block_pool.py's rules (a FIFO queue of free blocks, popped at its head, released blocks pushed at its
tail lowest id first, a reference count per block), and logs what each step did: the blocks it
released and took, in order, and the reference counts it changed.

The pool of record stays the functional one, a pytree of JAX arrays on the host's CPU device:
`commit`, once a step, replays the log on it in one jitted call (block_pool.apply_log, padded to
the narrowest of POOL_IDS' widths that holds it, so a few programs; one call, as a second would wait
on the CPU for the first's result). The call also checks that the blocks the host handed out are
those the pool's queue gives; its flag is read at the next commit, when it is long done, so the
check costs the step no wait. A replay of the scheduler alone (replay.py) asks for no pool of record
(`functional_pool=False`).
"""

import collections
import dataclasses

import jax
import numpy as np

from paged_jax.core import block_pool
from paged_jax.core.buckets import POOL_IDS, pad_ids
from paged_jax.core.prefix_cache import ROOT_HASH, PrefixCache, block_hashes

WIDEST = POOL_IDS[-1]

# The log's four id lists travel as one int32 [4, width] array: one transfer, not four.
_apply_log = jax.jit(lambda pool, log: block_pool.apply_log(pool, *log), donate_argnums=0)


@dataclasses.dataclass
class _Log:
    """What the host did to the pool since the last commit: stretches of at most WIDEST blocks released
    and WIDEST taken, each replayed in one call, then the reference counts it changed."""

    stretches: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=lambda: [([], [])])
    touched: set[int] = dataclasses.field(default_factory=set)

    def release(self, ids: list[int]) -> None:
        for block in ids:
            if len(self.stretches[-1][0]) == WIDEST:
                self.stretches.append(([], []))
            self.stretches[-1][0].append(block)

    def take(self, ids: list[int]) -> None:
        for block in ids:
            if len(self.stretches[-1][1]) == WIDEST:
                self.stretches.append(([], []))
            self.stretches[-1][1].append(block)

    def __bool__(self) -> bool:
        return bool(self.touched)  # every block released or taken is touched too


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 functional_pool: bool = True):
        """functional_pool: keep the pool of record (block_pool.BlockPool) and replay each step on it."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block {block_pool.NULL_BLOCK} is reserved), "
                             f"got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcounts = np.zeros(num_blocks, np.int32)
        self._queue = collections.deque(range(1, num_blocks))
        self._log = _Log()
        self._oks: list[jax.Array] = []  # the last commit's flags, read at the next
        self.pool = None
        if functional_pool:
            self._cpu = jax.local_devices(backend="cpu")[0]  # this process's, in a group of processes
            # Committed, as every pool a call returns is: else the first call would need a program of its own.
            self.pool = jax.device_put(block_pool.init_pool(num_blocks), self._cpu)
        self.cache = PrefixCache(num_blocks) if enable_prefix_caching else None

    @property
    def num_free(self) -> int:
        return len(self._queue)

    def warm_up(self) -> None:
        """Make the commit's programs, one a width, by calls that change nothing."""
        if self.pool is not None:
            for width in POOL_IDS:
                self._call([], [], [], [], width)
            self.check()

    def commit(self) -> None:
        """Replay the log on the pool of record (a dispatch; nothing waits for it), after checking the
        previous commit's replay agreed."""
        if self.pool is None:
            self._log = _Log()
            return
        self.check()
        log, self._log = self._log, _Log()
        if log:
            touched = sorted(log.touched)
            self._replay(log.stretches, touched, self.refcounts[touched].tolist())

    def check(self) -> None:
        """Raise if the last commit found the host's bookkeeping and the pool's queue disagreeing (a bug)."""
        oks, self._oks = self._oks, []
        if not all(bool(ok) for ok in oks):
            raise RuntimeError("the block pool's queue disagrees with the blocks the engine handed out")

    def _replay(self, stretches: list[tuple[list[int], list[int]]], touched: list[int], counts: list[int]) -> None:
        """One call a stretch; the reference counts go with the last one (and more calls if they are
        many): a call's taken blocks get a count of 1, which the final counts must follow."""
        chunks = [(touched[i : i + WIDEST], counts[i : i + WIDEST]) for i in range(0, len(touched), WIDEST)]
        calls = len(stretches) - 1 + max(1, len(chunks))
        for i in range(calls):
            released, taken = stretches[i] if i < len(stretches) else ([], [])
            ids, values = chunks[i - len(stretches) + 1] if 0 <= i - len(stretches) + 1 < len(chunks) else ([], [])
            longest = max(len(released), len(taken), len(ids))
            self._call(released, taken, ids, values, next(w for w in POOL_IDS if w >= longest))

    def _call(self, released: list[int], taken: list[int], ids: list[int], values: list[int], width: int) -> None:
        log = np.stack([pad_ids(part, width, -1) for part in (released, taken, ids, values)])
        self.pool, ok = _apply_log(self.pool, jax.device_put(log, self._cpu))
        self._oks.append(ok)

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
        if n > self.num_free:
            raise RuntimeError(f"block pool refused to allocate {n} blocks ({self.num_free} free)")
        ids = [self._queue.popleft() for _ in range(n)]
        for block in ids:  # as fast as one indexed write at 64 ids, 14x faster at one (a decode's)
            self.refcounts[block] = 1
        self._log.take(ids)
        self._log.touched.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference per entry of ids (a block may appear once per reference it loses)."""
        if not ids:
            return
        counts = collections.Counter(ids)
        blocks = list(counts)
        if not all(0 < b < self.num_blocks and counts[b] <= self.refcounts[b] for b in blocks):
            # The scheduler's bookkeeping disagrees with the pool: a bug, never a user error.
            raise RuntimeError(f"block pool refused to free blocks {list(ids)}")
        self.refcounts[blocks] -= np.fromiter(counts.values(), np.int32, len(blocks))
        released = sorted(b for b in blocks if self.refcounts[b] == 0)
        self._queue.extend(released)
        self._log.release(released)
        self._log.touched.update(blocks)

    def share(self, ids: list[int]) -> None:
        """Add one reference per entry of ids, each a block in use."""
        if not ids:
            return
        if not all(0 < b < self.num_blocks and self.refcounts[b] > 0 for b in ids):
            raise RuntimeError(f"block pool refused to share blocks {list(ids)}")
        for block in ids:  # one at a time: np.add.at costs microseconds a call, and most calls name one block
            self.refcounts[block] += 1
        self._log.touched.update(ids)

    def is_shared(self, block: int) -> bool:
        """Whether a write to block must go to a private copy first."""
        return self.refcounts[block] > 1

    def copy_on_write(self, block: int) -> tuple[int, int]:
        """(block, its private copy) for a shared block about to be written; the copy is one fresh
        block, so the caller checks can_allocate(1) first."""
        if not self.is_shared(block):
            raise RuntimeError(f"block pool refused to copy block {block}, which is not shared")
        (dst,) = self.allocate(1)
        self.refcounts[block] -= 1
        self._log.touched.add(block)
        return block, dst

    # Prefix caching.

    def match_prefix(self, token_ids: list[int], root: int = ROOT_HASH) -> list[int]:
        """Cached blocks of the longest prefix of token_ids, leaving at least one token to compute
        (its logits are needed). The caller shares them once admission is certain. root: the parent of
        the first block's name (Sequence.prefix_root: a LoRA adapter's K/V is its own)."""
        if self.cache is None:
            return []
        return self.cache.match(block_hashes(token_ids[:-1], self.block_size, root))

    def cache_full_blocks(self, token_ids: list[int], block_ids: list[int], num_cached: int, num_computed: int,
                          hashes: list[int] | None = None, root: int = ROOT_HASH) -> int:
        """Name the blocks that became full and computed; returns the new count of named blocks.

        hashes: the sequence's block names so far, extended here, so that each is computed once (a
        name chains every earlier block's tokens); root: as match_prefix takes it."""
        full = num_computed // self.block_size
        if self.cache is None or full <= num_cached:
            return num_cached
        hashes = [] if hashes is None else hashes
        if len(hashes) < full:
            start = len(hashes) * self.block_size
            hashes += block_hashes(token_ids[start : full * self.block_size], self.block_size,
                                   hashes[-1] if hashes else root)
        newly_held = [b for h, b in zip(hashes[num_cached:full], block_ids[num_cached:full]) if self.cache.insert(h, b)]
        self.share(newly_held)
        return full

    def reset_prefix_cache(self) -> None:
        """Drop every cached block: afterwards a pool with no running sequence is all free."""
        if self.cache is not None:
            self.free(self.cache.clear())

    @property
    def num_evictable(self) -> int:
        return 0 if self.cache is None else self.cache.num_evictable(self.refcounts)
