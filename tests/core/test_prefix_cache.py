"""The prefix cache on its own: block names that chain over every earlier block, the longest cached
prefix, one reference taken per named block, eviction of the least recently used blocks only the cache
holds."""

import numpy as np
import pytest

from paged_jax.core.prefix_cache import PrefixCache, block_hashes

BS = 4
X, Y, Z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def test_only_full_blocks_are_named():
    assert block_hashes([], BS) == []
    assert block_hashes(X[:3], BS) == []
    assert len(block_hashes(X + Y + [13, 14], BS)) == 2
    assert block_hashes(X + Y, BS) == block_hashes(X + Y + [13], BS)


def test_a_name_covers_every_token_before_the_block():
    """The same tokens at the same position after another beginning are another block: their KV,
    computed attending to that beginning, differs."""
    after_x, after_z = block_hashes(X + Y, BS), block_hashes(Z + Y, BS)
    assert after_x[1] != after_z[1]
    # One token changed in the first block renames every block after it.
    changed = block_hashes([1, 2, 3, 99] + Y + Z, BS)
    assert all(a != b for a, b in zip(block_hashes(X + Y + Z, BS), changed, strict=True))
    # Equal prefixes, equal names.
    assert block_hashes(X + Y + Z, BS)[:2] == after_x


def test_a_block_is_not_named_by_its_position_alone():
    assert block_hashes(X + X, BS)[0] != block_hashes(X + X, BS)[1]


def cache_of(named: dict[int, int], num_blocks: int = 16) -> PrefixCache:
    """A cache holding {name: block}, inserted in that order (the first least recently used)."""
    cache = PrefixCache(num_blocks)
    for name, block in named.items():
        assert cache.insert(name, block)
    return cache


def test_match_returns_the_longest_cached_prefix_and_counts_hits():
    hx, hy, hz = block_hashes(X + Y + Z, BS)
    cache = cache_of({hx: 3, hy: 5})
    assert cache.match([hx, hy, hz]) == [3, 5]
    assert cache.match([hy]) == [5]
    # A miss ends the prefix, even where a later name is cached.
    assert cache.match([hz, hy]) == []
    assert (cache.queried_blocks, cache.hit_blocks) == (3 + 1 + 2, 2 + 1)


def test_a_name_is_inserted_once():
    cache = cache_of({11: 3})
    assert not cache.insert(11, 4)  # another block computed the same prefix: the cache keeps its own
    assert cache.match([11]) == [3] and len(cache) == 1


def refcounts(held: dict[int, int], num_blocks: int = 16) -> np.ndarray:
    out = np.zeros(num_blocks, np.int32)
    for block, count in held.items():
        out[block] = count
    return out


def test_eviction_takes_the_least_recently_used_blocks_only_the_cache_holds():
    cache = cache_of({11: 1, 12: 2, 13: 3, 14: 4})
    cache.match([11])  # block 1 is now the most recently used
    counts = refcounts({1: 1, 2: 2, 3: 1, 4: 1})  # block 2 is also held by a sequence
    assert cache.num_evictable(counts) == 3
    assert cache.evict(counts, 2) == [3, 4]
    assert cache.evict(counts, 5) == [1]
    assert cache.match([12]) == [2] and len(cache) == 1
    assert cache.num_evictable(counts) == 0


def test_insert_refreshes_a_known_name():
    cache = cache_of({11: 1, 12: 2})
    cache.insert(11, 5)
    assert cache.evict(refcounts({1: 1, 2: 1}), 1) == [2]


@pytest.mark.parametrize("keep", [[], [2], [2, 2, 3], [9]])
def test_kept_blocks_are_not_counted_as_evictable(keep):
    cache = cache_of({11: 1, 12: 2, 13: 3})
    counts = refcounts({1: 1, 2: 1, 3: 2, 9: 1})  # 3 is held by a sequence; 9 is not cached
    assert cache.num_evictable(counts, keep) == 2 - len({2} & set(keep))


def test_an_evicted_block_may_be_named_again():
    cache = cache_of({11: 1})
    assert cache.evict(refcounts({1: 1}), 1) == [1]
    assert cache.num_evictable(refcounts({1: 1})) == 0
    assert cache.insert(12, 1) and cache.num_evictable(refcounts({1: 1})) == 1


def test_clear_hands_back_every_cached_block():
    cache = cache_of({11: 1, 12: 2, 13: 3})
    assert sorted(cache.clear()) == [1, 2, 3]
    assert len(cache) == 0 and cache.match([11]) == [] and cache.num_evictable(refcounts({1: 1})) == 0


def test_a_name_keeps_what_it_hashed_and_is_its_plain_value():
    x, y = block_hashes(X + Y, BS)
    assert (x.parent, x.token_ids, y.parent, y.token_ids) == (0, tuple(X), x, tuple(Y))
    assert y == hash((int(x), tuple(Y))) and {int(y): 1}[y] == 1  # the same name, and key, as a plain int


def test_the_event_log_follows_stores_evictions_and_clears():
    cache = PrefixCache(16)
    assert cache.insert(7, 1) and cache.events is None  # nothing logged until someone asks
    cache.events = []
    x, y = block_hashes(X + Y, BS)
    assert cache.insert(x, 2) and cache.insert(y, 3) and not cache.insert(x, 2)  # stored once, x used last
    refcounts = np.ones(16, np.int32)
    assert cache.evict(refcounts, 2) == [1, 3]
    assert cache.evict(refcounts, 0) == []  # nothing evicted, nothing logged
    cache.clear()
    assert cache.events == [("stored", x), ("stored", y), ("removed", [7, y]), ("cleared",)]
    assert list(cache.names()) == []
