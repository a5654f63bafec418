"""The block manager on its own, with and without its pool of record: reference counts, the prefix
cache's own reference on each named block, eviction when the pool runs short, copy-on-write, and a pool
all free once everything is let go. With the pool of record, every check first commits the log to it
and compares its reference counts and free count with the host's."""

import numpy as np
import pytest

from paged_jax.core.block_manager import BlockManager

BS = 4
NUM_BLOCKS = 9  # 8 usable


@pytest.fixture(params=[True, False], ids=["functional_pool", "bookkeeping_alone"])
def manager(request) -> BlockManager:
    return BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=True, functional_pool=request.param)


def refs(manager: BlockManager) -> dict[int, int]:
    """block -> reference count, for the referenced blocks; checks the free count agrees, and the pool
    of record, the log committed to it, with the host."""
    counts = manager.refcounts
    if manager.pool is not None:
        manager.commit()
        manager.check()
        np.testing.assert_array_equal(np.asarray(manager.pool.refcounts), counts)
        assert int(manager.pool.num_free) == manager.num_free
    assert manager.num_free == NUM_BLOCKS - 1 - np.count_nonzero(counts)
    return {int(b): int(counts[b]) for b in np.flatnonzero(counts)}


def assert_all_free(manager: BlockManager) -> None:
    manager.reset_prefix_cache()
    assert refs(manager) == {} and manager.num_free == NUM_BLOCKS - 1 and manager.num_evictable == 0


def test_allocate_share_free_count_references(manager):
    a = manager.allocate(3)
    assert len(set(a)) == 3 and 0 not in a
    manager.share(a[:2])
    assert refs(manager) == {a[0]: 2, a[1]: 2, a[2]: 1}
    assert manager.is_shared(a[0]) and not manager.is_shared(a[2])
    manager.free(a)
    assert refs(manager) == {a[0]: 1, a[1]: 1}
    manager.free(a[:2])
    assert_all_free(manager)


def test_freed_blocks_are_handed_out_again(manager):
    first = manager.allocate(NUM_BLOCKS - 1)
    assert sorted(first) == list(range(1, NUM_BLOCKS)) and manager.num_free == 0
    manager.free(first[:3])
    assert sorted(manager.allocate(3)) == sorted(first[:3])


def test_a_free_the_pool_refuses_is_a_bug_and_changes_nothing(manager):
    a = manager.allocate(2)
    manager.free(a[:1])
    with pytest.raises(RuntimeError, match="refused to free"):
        manager.free(a)  # a[0] is free already
    assert refs(manager) == {a[1]: 1}
    with pytest.raises(RuntimeError, match="refused to allocate"):
        manager.allocate(NUM_BLOCKS)


def test_copy_on_write_gives_a_private_block_and_drops_one_reference(manager):
    (block,) = manager.allocate(1)
    manager.share([block])
    src, dst = manager.copy_on_write(block)
    assert src == block and dst not in (0, block)
    assert refs(manager) == {block: 1, dst: 1}


def fill(manager: BlockManager, tokens: list[int]) -> list[int]:
    """A sequence's blocks for `tokens`, all computed and named, as the scheduler leaves them."""
    blocks = manager.allocate(-(-len(tokens) // BS))
    named = manager.cache_full_blocks(tokens, blocks, 0, len(tokens))
    assert named == len(tokens) // BS
    return blocks


def test_named_blocks_carry_the_caches_reference_and_outlive_their_sequence(manager):
    tokens = list(range(10, 20))  # two full blocks and a partial one
    blocks = fill(manager, tokens)
    assert refs(manager) == {blocks[0]: 2, blocks[1]: 2, blocks[2]: 1}
    # Naming again (a later step of the same sequence) takes no second reference.
    assert manager.cache_full_blocks(tokens, blocks, 2, len(tokens)) == 2
    assert refs(manager) == {blocks[0]: 2, blocks[1]: 2, blocks[2]: 1}
    manager.free(blocks)
    assert refs(manager) == {blocks[0]: 1, blocks[1]: 1} and manager.num_evictable == 2
    assert manager.match_prefix(tokens) == blocks[:2]
    assert_all_free(manager)


def test_a_prefix_computed_twice_is_named_once(manager):
    """Two sequences that computed the same blocks side by side: the cache keeps the first's, and
    takes no reference on the second's, which go back to the pool with their sequence."""
    tokens = list(range(10, 18))
    first, second = fill(manager, tokens), fill(manager, tokens)
    assert refs(manager) == {**{b: 2 for b in first}, **{b: 1 for b in second}}
    manager.free(second)
    assert refs(manager) == {b: 2 for b in first}
    manager.free(first)
    assert_all_free(manager)


def test_only_computed_full_blocks_are_named(manager):
    tokens = list(range(10, 22))
    blocks = manager.allocate(3)
    assert manager.cache_full_blocks(tokens, blocks, 0, 7) == 1  # 7 computed: one full block
    assert refs(manager) == {blocks[0]: 2, blocks[1]: 1, blocks[2]: 1}
    assert manager.match_prefix(tokens + [1]) == blocks[:1]


def test_a_match_leaves_the_last_token_to_compute(manager):
    tokens = list(range(10, 18))  # exactly two blocks
    blocks = fill(manager, tokens)
    # Its logits are needed, so the block holding the last token is computed again.
    assert manager.match_prefix(tokens) == blocks[:1]
    assert manager.match_prefix(tokens + [1]) == blocks[:2]


def test_the_same_tokens_after_another_beginning_do_not_match(manager):
    x, y, z = [1] * BS, [2] * BS, [3] * BS
    fill(manager, x + y + [9])
    z_blocks = fill(manager, z + [9])
    assert manager.match_prefix(z + y + [9]) == z_blocks[:1]


def test_allocation_evicts_cached_blocks_least_recently_used_first(manager):
    old = fill(manager, [1] * 8)  # two named blocks
    new = fill(manager, [2] * 8)
    manager.free(old + new)
    manager.match_prefix([2] * 8 + [0])  # `new` used last
    taken = manager.allocate(NUM_BLOCKS - 1 - 2)  # two more than the free blocks
    assert set(old) <= set(taken) and not set(new) & set(taken)
    assert manager.match_prefix([1] * 8 + [0]) == [] and manager.match_prefix([2] * 8 + [0]) == new


def test_can_allocate_counts_evictable_blocks_but_not_those_kept(manager):
    cached = fill(manager, [1] * 8)
    manager.free(cached)
    manager.allocate(manager.num_free)
    assert manager.num_free == 0 and manager.num_evictable == 2
    assert manager.can_allocate(2) and not manager.can_allocate(3)
    # A request about to share the cached blocks cannot also have them evicted for its own.
    assert not manager.can_allocate(1, keep=cached) and manager.can_allocate(1, keep=cached[:1])


def test_a_shared_cached_block_is_never_evicted(manager):
    fill(manager, [1] * 8)  # still held by its sequence
    manager.allocate(manager.num_free)
    assert manager.num_evictable == 0 and not manager.can_allocate(1)


def test_without_prefix_caching_nothing_is_named_or_matched():
    manager = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=False, functional_pool=False)
    blocks = manager.allocate(2)
    assert manager.cache_full_blocks(list(range(8)), blocks, 0, 8) == 0
    assert manager.match_prefix(list(range(9))) == [] and refs(manager) == {b: 1 for b in blocks}
    manager.free(blocks)
    assert_all_free(manager)

