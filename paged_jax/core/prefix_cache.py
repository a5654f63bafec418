"""Prefix caching: full KV blocks named by a hash chain over their token ids.

Block i of a sequence is named by hash(name of block i-1, its block_size token ids), so equal names
mean equal prefixes, and a new request reuses the blocks of its longest matching prefix.

The cache holds one reference of its own on every block it names (taken through the block pool's
share), so a cached block outlives the sequences that computed it. When the pool runs short, blocks
that only the cache still holds (refcount 1) are evicted, least recently used first.
"""

import collections
import itertools
from collections.abc import Iterable, Sequence

import numpy as np

ROOT_HASH = 0


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Names of the full blocks of token_ids (a trailing partial block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Host-side map from block name to physical block id, ordered by last use."""

    def __init__(self, num_blocks: int):
        self._blocks: collections.OrderedDict[int, int] = collections.OrderedDict()
        # The named blocks as a mask, to count the evictable ones in a few vector operations. A block
        # has at most one name: it is named once, by the step that fills it.
        self._named = np.zeros(num_blocks, bool)
        self.queried_blocks = 0
        self.hit_blocks = 0

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

    def insert(self, h: int, block: int) -> bool:
        """Name a freshly computed full block; True when the cache took a new reference on it."""
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return False
        self._blocks[h] = block
        self._named[block] = True
        return True

    def evict(self, refcounts, n: int) -> list[int]:
        """Forget up to n least recently used blocks that only the cache holds; returns their ids.

        refcounts: int [num_blocks], the pool's reference counts (host copy).
        """
        refcounts = np.asarray(refcounts).tolist()  # Python ints: faster to index one at a time
        victims = list(itertools.islice((h for h, b in self._blocks.items() if refcounts[b] == 1), n))
        blocks = [self._blocks.pop(h) for h in victims]
        self._named[blocks] = False
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
        return blocks

    def cached_ids(self) -> Iterable[int]:
        return self._blocks.values()
