"""Prefix caching: full KV blocks named by a hash chain over their token ids.

Block i of a sequence is named by hash(name of block i-1, its block_size token ids), so equal names
mean equal prefixes, and a new request reuses the blocks of its longest matching prefix.

The cache holds one reference of its own on every block it names (taken through the block pool's
share), so a cached block outlives the sequences that computed it. When the pool runs short, blocks
that only the cache still holds (refcount 1) are evicted, least recently used first.

What the cache does can be logged for others to follow (`events`, a list the serving side drains
after each step and publishes as vLLM's KV-cache events: serving/kv_events.py): a name stored, names
removed, everything cleared. A stored name carries its parent's name and its block's token ids
(BlockName), which the publisher sends along, so a router can rebuild the chain from the tokens.
"""

import collections
import itertools
from collections.abc import Iterable, Sequence

import numpy as np

ROOT_HASH = 0


class BlockName(int):
    """A block's name, hash((parent, token_ids)), which also keeps what it hashed: an int everywhere
    (equal to, and hashing as, the plain value), and what a KV-cache event says of the block."""

    parent: int  # the name of the block before it (ROOT_HASH for a sequence's first)
    token_ids: tuple[int, ...]  # [block_size]

    def __new__(cls, parent: int, token_ids: tuple[int, ...]) -> "BlockName":
        name = super().__new__(cls, hash((parent, token_ids)))
        name.parent, name.token_ids = int(parent), token_ids
        return name

    def __reduce__(self):  # pickle and copy build it again from what it hashed
        return BlockName, (self.parent, self.token_ids)


class GroupName(int):
    """The name of a block of a KV group past the first (window_blocks.group_name): cached as any, but
    left out of the events, which tell the first group's blocks alone."""


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[BlockName]:
    """Names of the full blocks of token_ids (a trailing partial block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = BlockName(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


# What `PrefixCache.events` logs: ("stored", BlockName), ("removed", [names]), ("cleared",).
CacheEvent = tuple


class PrefixCache:
    """Host-side map from block name to physical block id, ordered by last use."""

    def __init__(self, num_blocks: int):
        self._blocks: collections.OrderedDict[int, int] = collections.OrderedDict()
        # The named blocks as a mask, to count the evictable ones in a few vector operations. A block
        # has at most one name: it is named once, by the step that fills it.
        self._named = np.zeros(num_blocks, bool)
        self.queried_blocks = 0
        self.hit_blocks = 0
        # When a list, every name stored and removed is appended to it (CacheEvent), in order, for
        # whoever drains it; None (the default) logs nothing.
        self.events: list[CacheEvent] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`, marked as just used."""
        found = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            self._blocks.move_to_end(h)
            found.append(block)
        self.queried_blocks += len(hashes)
        self.hit_blocks += len(found)
        return found

    def get(self, h: int) -> int | None:
        """The block named h, if cached; its place in the eviction order unchanged (touch marks it used)."""
        return self._blocks.get(h)

    def touch(self, hashes: Iterable[int]) -> None:
        """Mark the cached blocks named by hashes as just used."""
        for h in hashes:
            self._blocks.move_to_end(h)

    def insert(self, h: int, block: int) -> bool:
        """Name a freshly computed full block; True when the cache took a new reference on it."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return False
        self._blocks[h] = block
        self._named[block] = True
        if self.events is not None and not isinstance(h, GroupName):
            self.events.append(("stored", h))
        return True

    def evict(self, refcounts, n: int) -> list[int]:
        """Forget up to n least recently used blocks that only the cache holds; returns their ids.

        refcounts: int [num_blocks], the pool's reference counts (host copy).
        """
        refcounts = np.asarray(refcounts).tolist()  # Python ints: faster to index one at a time
        victims = list(itertools.islice((h for h, b in self._blocks.items() if refcounts[b] == 1), n))
        blocks = [self._blocks.pop(h) for h in victims]
        self._named[blocks] = False
        if self.events is not None and (told := [h for h in victims if not isinstance(h, GroupName)]):
            self.events.append(("removed", told))
        return blocks

    def num_evictable(self, refcounts, keep: Iterable[int] = ()) -> int:
        """Blocks only the cache holds (refcounts: int [num_blocks]), less those in keep."""
        evictable = self._named & (np.asarray(refcounts) == 1)
        return int(np.count_nonzero(evictable)) - sum(1 for b in set(keep) if evictable[b])

    def clear(self) -> list[int]:
        """Forget every block; returns the ids whose cache reference the caller must free."""
        blocks = list(self._blocks.values())
        self._blocks.clear()
        self._named[:] = False
        if self.events is not None:
            self.events.append(("cleared",))
        return blocks

    def cached_ids(self) -> Iterable[int]:
        return self._blocks.values()

    def names(self) -> Iterable[int]:
        """The names of the blocks held, least recently used first."""
        return self._blocks.keys()
