import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.core import block_pool as bp

NUM_BLOCKS = 10  # 9 usable: small, so random runs exhaust the pool often
MAX_N = 6
K = 8  # fixed length of every id vector, so each jitted op compiles once
SETTINGS = settings(max_examples=40, deadline=None)


def padded(ids, length=K):
    return jnp.array(list(ids) + [-1] * (length - len(ids)), jnp.int32)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def free_list(pool):
    queue = np.asarray(pool.free_queue)
    return queue[(int(pool.head) + np.arange(int(pool.num_free))) % queue.size]


def check_invariants(pool, refs):
    """refs: the references clients hold, one entry per reference (the model of the pool)."""
    refcounts = np.asarray(pool.refcounts)
    free = free_list(pool)
    assert len(set(free.tolist())) == free.size, "a block is on the free list twice"
    assert (refcounts >= 0).all()
    assert refcounts[bp.NULL_BLOCK] == 0 and bp.NULL_BLOCK not in free
    is_free = np.zeros(NUM_BLOCKS, bool)
    is_free[free] = True
    in_use = refcounts > 0
    assert not (is_free & in_use).any(), "a block is both free and referenced"
    assert (is_free | in_use)[1:].all(), "a block is neither free nor referenced"
    assert int(pool.num_free) + int(bp.num_in_use(pool)) == pool.capacity == NUM_BLOCKS - 1
    held = collections.Counter(refs)
    assert {b: int(refcounts[b]) for b in np.flatnonzero(in_use)} == dict(held)


@SETTINGS
@given(st.data())
def test_random_interleavings_keep_invariants(data):
    pool = bp.init_pool(NUM_BLOCKS)
    refs = []
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        op = data.draw(st.sampled_from(["allocate", "free", "share", "copy_on_write", "bad_free", "bad_share"]))
        before = pool
        pick = st.lists(st.integers(0, max(len(refs) - 1, 0)), unique=True, max_size=min(K, len(refs)))
        if op == "allocate":
            n = data.draw(st.integers(-1, MAX_N + 1), label="n")
            pool, ids, ok = bp.allocate(pool, n, MAX_N)
            ids = np.asarray(ids)
            assert bool(ok) == (0 <= n <= min(MAX_N, int(before.num_free)))
            if ok:
                new = ids[:n].tolist()
                assert len(set(new)) == n and not set(new) & set(refs) and bp.NULL_BLOCK not in new
                assert (ids[n:] == -1).all()
                refs += new
            else:
                assert (ids == -1).all()
                assert_same(pool, before)
        elif op == "free":
            chosen = data.draw(pick, label="free")
            ids = data.draw(st.permutations(padded([refs[i] for i in chosen]).tolist()))
            pool, ok = bp.free(pool, jnp.array(ids, jnp.int32))
            assert ok
            refs = [r for i, r in enumerate(refs) if i not in chosen]
        elif op == "share":
            chosen = data.draw(st.lists(st.sampled_from(refs), max_size=K) if refs else st.just([]), label="share")
            pool, ok = bp.share(pool, padded(chosen))
            assert ok
            refs += chosen
        elif op == "copy_on_write":
            chosen = data.draw(pick, label="write")
            ids = [refs[i] for i in chosen]
            refcounts = np.asarray(before.refcounts)
            seen = collections.Counter()
            expect_copy = []
            for b in ids:
                expect_copy.append(seen[b] < refcounts[b] - 1)
                seen[b] += 1
            pool, new_ids, copies, ok = bp.copy_on_write(pool, padded(ids))
            new_ids, copies = np.asarray(new_ids), np.asarray(copies)
            assert bool(ok) == (sum(expect_copy) <= int(before.num_free))
            if ok:
                fresh = [int(new_ids[i]) for i, c in enumerate(expect_copy) if c]
                assert len(set(fresh)) == len(fresh) and not set(fresh) & set(refs)
                for i, (b, c) in enumerate(zip(ids, expect_copy)):
                    assert copies[i].tolist() == ([b, int(new_ids[i])] if c else [-1, -1])
                    assert c or new_ids[i] == b
                    refs[chosen[i]] = int(new_ids[i])
            else:
                assert (copies == -1).all() and new_ids.tolist() == padded(ids).tolist()
                assert_same(pool, before)
        elif op == "bad_free":
            # One more entry than the block has references: a double free.
            block = data.draw(st.integers(1, NUM_BLOCKS - 1), label="block")
            extra = int(before.refcounts[block]) + 1
            if extra > K:
                continue
            pool, ok = bp.free(pool, padded([block] * extra))
            assert not ok
            assert_same(pool, before)
        else:
            block = data.draw(st.sampled_from([bp.NULL_BLOCK, NUM_BLOCKS, *free_list(before).tolist()]))
            pool, ok = bp.share(pool, padded([block]))
            assert not ok
            assert_same(pool, before)
        check_invariants(pool, refs)


def test_too_large_request_fails_and_leaves_pool_unchanged():
    pool, _, ok = bp.allocate(bp.init_pool(NUM_BLOCKS), 5, MAX_N)
    assert ok and int(pool.num_free) == 4
    for n in (5, MAX_N + 1, -1):
        after, ids, ok = bp.allocate(pool, n, MAX_N)
        assert not ok
        assert (np.asarray(ids) == -1).all()
        assert_same(after, pool)
    _, ids, ok = bp.allocate(pool, 4, MAX_N)
    assert ok and sorted(np.asarray(ids)[:4].tolist()) == [6, 7, 8, 9]


def test_freed_blocks_are_reused_oldest_first():
    pool, ids, _ = bp.allocate(bp.init_pool(5), 4, 4)
    assert np.asarray(ids).tolist() == [1, 2, 3, 4]
    pool, _ = bp.free(pool, jnp.array([3, -1]))
    pool, _ = bp.free(pool, jnp.array([1, -1]))
    _, ids, _ = bp.allocate(pool, 2, 4)
    assert np.asarray(ids).tolist() == [3, 1, -1, -1]


def test_copy_on_write_leaves_the_last_reference_the_original():
    pool, ids, _ = bp.allocate(bp.init_pool(NUM_BLOCKS), 2, 2)
    a, b = np.asarray(ids).tolist()
    pool, _ = bp.share(pool, jnp.array([a, a]))
    pool, new_ids, copies, ok = bp.copy_on_write(pool, jnp.array([a, b, a, a]))
    assert ok
    new_ids = np.asarray(new_ids).tolist()
    assert new_ids[1] == b and new_ids[3] == a and len({*new_ids}) == 4
    assert np.asarray(copies).tolist() == [[a, new_ids[0]], [-1, -1], [a, new_ids[2]], [-1, -1]]
    assert np.asarray(pool.refcounts)[[a, b, new_ids[0], new_ids[2]]].tolist() == [1, 1, 1, 1]


def test_copy_on_write_without_room_fails_and_leaves_pool_unchanged():
    pool, ids, _ = bp.allocate(bp.init_pool(4), 3, 3)
    pool, _ = bp.share(pool, ids)
    after, new_ids, copies, ok = bp.copy_on_write(pool, ids)
    assert not ok
    assert_same(after, pool)
    assert np.asarray(new_ids).tolist() == np.asarray(ids).tolist()
    assert (np.asarray(copies) == -1).all()


@pytest.mark.parametrize("ids", [[bp.NULL_BLOCK], [NUM_BLOCKS], [3]])
def test_free_rejects_ids_that_are_not_referenced_blocks(ids):
    pool = bp.init_pool(NUM_BLOCKS)
    after, ok = bp.free(pool, padded(ids))
    assert not ok
    assert_same(after, pool)


def test_each_op_compiles_once_for_any_count():
    pool = bp.init_pool(NUM_BLOCKS)
    before = bp.allocate._cache_size()
    for n in range(MAX_N + 2):
        bp.allocate(pool, n, MAX_N)
    assert bp.allocate._cache_size() - before <= 1


def test_ops_compose_under_an_outer_jit():
    def step(pool):
        pool, ids, ok1 = bp.allocate(pool, 3, 4)
        pool, ok2 = bp.share(pool, ids)
        pool, new_ids, copies, ok3 = bp.copy_on_write(pool, ids)
        pool, ok4 = bp.free(pool, jnp.concatenate([ids, new_ids]))
        return pool, copies, ok1 & ok2 & ok3 & ok4

    pool = bp.init_pool(NUM_BLOCKS)
    eager = step(pool)
    assert eager[2]
    assert_same(jax.jit(step)(pool), eager)
    assert int(eager[0].num_free) == NUM_BLOCKS - 1


BATCH = 3
# Built once: a jit made inside the test would compile again for every example.
batched_allocate = jax.jit(jax.vmap(lambda pool, n: bp.allocate(pool, n, MAX_N)))
batched_share = jax.jit(jax.vmap(bp.share))
batched_copy_on_write = jax.jit(jax.vmap(bp.copy_on_write))
batched_free = jax.jit(jax.vmap(bp.free))


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.integers(0, MAX_N + 1), min_size=BATCH, max_size=BATCH),
    st.lists(st.integers(0, MAX_N + 1), min_size=BATCH, max_size=BATCH),
    st.lists(st.lists(st.booleans(), min_size=MAX_N, max_size=MAX_N), min_size=BATCH, max_size=BATCH),
)
def test_vmap_runs_independent_pools(first, second, masks):
    """A batch of pools under vmap behaves lane by lane as the unbatched ops, failures included."""
    lanes = [bp.init_pool(NUM_BLOCKS)] * BATCH
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *lanes)
    mask = jnp.array(masks)

    def run_both(batched_op, op, *args):
        nonlocal batch, lanes
        out = batched_op(batch, *args)
        expected = [op(lane, *(a[i] for a in args)) for i, lane in enumerate(lanes)]
        assert_same(out, jax.tree.map(lambda *xs: jnp.stack(xs), *expected))
        batch, lanes = out[0], [e[0] for e in expected]
        return out

    _, ids, _ = run_both(batched_allocate, lambda p, n: bp.allocate(p, n, MAX_N), jnp.array(first))
    run_both(batched_share, bp.share, jnp.where(mask, ids, -1))
    _, ids2, _ = run_both(batched_allocate, lambda p, n: bp.allocate(p, n, MAX_N), jnp.array(second))
    run_both(batched_copy_on_write, bp.copy_on_write, jnp.where(mask, ids, -1))
    run_both(batched_free, bp.free, jnp.concatenate([ids, ids2], axis=1))


def test_apply_log_replays_operations_as_one_call():
    """A stretch of allocate / free / share, applied one op at a time, gives the pool that apply_log
    gives from their log (blocks released, blocks taken, final counts) in one call: on a full pool,
    a block taken then released (the ring must not overflow) and one released then taken again."""
    pool = bp.init_pool(NUM_BLOCKS)
    pool, first, _ = bp.allocate(pool, jnp.int32(NUM_BLOCKS - 1), MAX_N + 3)
    before = pool
    step = pool
    step, _ = bp.free(step, padded([3, 4]))  # pushes 3, 4
    step, taken, _ = bp.allocate(step, jnp.int32(1), MAX_N)  # takes 3 again
    step, _ = bp.share(step, padded([5]))
    step, _ = bp.free(step, padded([5, 5, 7]))  # 5 and 7 go
    taken = [int(x) for x in taken[:1]]
    touched = [3, 4, 5, 7]
    counts = [int(np.asarray(step.refcounts)[b]) for b in touched]
    replayed, ok = bp.apply_log(before, padded([3, 4, 5, 7]), padded(taken), padded(touched), padded(counts))
    assert bool(ok) and taken == [3]
    assert_same(replayed, step)


def test_apply_log_refuses_a_log_the_queue_disagrees_with_and_changes_nothing():
    pool = bp.init_pool(NUM_BLOCKS)
    # The queue hands out 1 first; a log that says 2 is a bookkeeping bug.
    replayed, ok = bp.apply_log(pool, padded([]), padded([2]), padded([2]), padded([1]))
    assert not bool(ok)
    assert_same(replayed, pool)
    # In the queue's order it is taken.
    replayed, ok = bp.apply_log(pool, padded([]), padded(range(1, K + 1)), padded([]), padded([]))
    assert bool(ok) and int(replayed.num_free) == NUM_BLOCKS - 1 - K
