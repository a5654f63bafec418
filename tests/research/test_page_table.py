import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_pallas import layout
from paged_jax.core import block_pool as bp
from paged_jax.research import page_table as pt

MAX_SEQS = 4
MAX_BLOCKS = 4
BLOCK_SIZE = 4
NUM_BLOCKS = 12  # 11 usable, fewer than MAX_SEQS * MAX_BLOCKS: random runs exhaust the pool


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def fresh(block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS, num_blocks=NUM_BLOCKS):
    return pt.init_page_table(MAX_SEQS, max_blocks, block_size), bp.init_pool(num_blocks)


def append(table, pool, lengths_by_seq, **kwargs):
    seqs = list(lengths_by_seq)
    seq_ids = jnp.array(seqs + [-1] * (MAX_SEQS - len(seqs)), jnp.int32)
    counts = jnp.array(list(lengths_by_seq.values()) + [0] * (MAX_SEQS - len(seqs)), jnp.int32)
    return pt.append_tokens(table, pool, seq_ids, counts, **kwargs)


def check_table(table, pool):
    """Rows own exactly ceil(length / block_size) distinct blocks, each referenced; NULL_BLOCK past them."""
    tables, lengths = np.asarray(table.block_tables), np.asarray(table.lengths)
    owned = []
    for row, length in zip(tables, lengths):
        n = -(-int(length) // table.block_size)
        assert (row[n:] == bp.NULL_BLOCK).all()
        owned += row[:n].tolist()
    assert bp.NULL_BLOCK not in owned
    assert (np.asarray(pool.refcounts)[owned] >= 1).all()
    return owned


def test_position_to_block():
    assert pt.position_to_block(37, 16) == (2, 5)
    block, offset = pt.position_to_block(jnp.array([0, 15, 16, 37]), 16)
    assert np.asarray(block).tolist() == [0, 0, 1, 2]
    assert np.asarray(offset).tolist() == [0, 15, 0, 5]


def test_blocks_for_tokens_is_ceil():
    lengths = jnp.array([0, 1, 15, 16, 17, 32, 33])
    assert np.asarray(pt.blocks_for_tokens(lengths, 16)).tolist() == [0, 1, 1, 1, 2, 2, 3]


def test_block_taken_exactly_when_a_boundary_is_crossed():
    table, pool = fresh(block_size=16, max_blocks=3)
    in_use = []
    for count in [15, 1, 1, 15, 1]:  # lengths 15, 16, 17, 32, 33
        table, pool, ok = append(table, pool, {0: count}, max_new_blocks=1)
        assert ok
        in_use.append(int(bp.num_in_use(pool)))
        check_table(table, pool)
    assert in_use == [1, 1, 2, 2, 3]


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_random_appends_and_releases_keep_rows_consistent(data):
    table, pool = fresh()
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        seqs = data.draw(st.lists(st.integers(0, MAX_SEQS - 1), unique=True, min_size=1), label="seqs")
        before_table, before_pool = table, pool
        if data.draw(st.booleans(), label="release"):
            table, pool, ok = pt.release(table, pool, jnp.array(seqs + [-1] * (MAX_SEQS - len(seqs))))
            assert ok
            assert (np.asarray(table.lengths)[seqs] == 0).all()
        else:
            counts = data.draw(st.lists(st.integers(0, 9), min_size=len(seqs), max_size=len(seqs)), label="counts")
            lengths = np.asarray(table.lengths)[seqs] + np.array(counts)
            blocks_after = pt.blocks_for_tokens(lengths, BLOCK_SIZE)
            needed = (blocks_after - pt.blocks_for_tokens(lengths - counts, BLOCK_SIZE)).sum()
            fits = needed <= int(pool.num_free) and (blocks_after <= MAX_BLOCKS).all()
            table, pool, ok = append(table, pool, dict(zip(seqs, counts)))
            assert bool(ok) == fits
            if ok:
                assert np.asarray(table.lengths)[seqs].tolist() == lengths.tolist()
            else:
                assert_same((table, pool), (before_table, before_pool))
        owned = check_table(table, pool)
        assert len(set(owned)) == len(owned), "two logical blocks share a physical block"
        assert int(bp.num_in_use(pool)) == len(owned)


def test_slot_mapping_matches_block_tables():
    table, pool = fresh()
    pool, _, _ = bp.allocate(pool, 3, 3)  # so the page table's blocks are not 1, 2, 3, ...
    table, pool, ok = append(table, pool, {2: 6, 0: 9})
    assert ok
    seq_ids = jnp.array([0, 0, 0, 2, 2, -1, 0])
    positions = jnp.array([0, 4, 8, 5, 1, 3, -1])
    rows = np.asarray(table.block_tables)
    expected = [rows[s, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for s, p in zip(seq_ids[:5], positions[:5])]
    assert np.asarray(pt.slot_mapping(table, seq_ids, positions)).tolist() == expected + [-1, -1]


@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
def test_slot_mapping_round_trips_through_the_kv_layout(kv_layout):
    """K written through slot_mapping and read back through block_tables comes out in token order."""
    table, pool = fresh()
    table, pool, _ = append(table, pool, {1: 3})
    table, pool, ok = append(table, pool, {0: 7, 1: 6})  # interleaves the two sequences' blocks
    assert ok
    seq_ids = jnp.array([0] * 7 + [1] * 9 + [-1])
    positions = jnp.array(list(range(7)) + list(range(9)) + [0])
    # Token t carries t in KV head 0 and -t in KV head 1; the padding token carries 16.
    values = jnp.arange(17, dtype=jnp.float32)[:, None, None] * jnp.array([1.0, -1.0])[None, :, None]
    pages = jnp.full(layout.page_shape(NUM_BLOCKS, BLOCK_SIZE, 2, 1, kv_layout), jnp.nan)
    pages, _ = layout.write_kv(pages, pages, pt.slot_mapping(table, seq_ids, positions), values, values, kv_layout)
    k = np.asarray(layout.gather_kv(pages, table.block_tables, kv_layout))[:, :, :, 0]  # [seqs, tokens, heads]
    assert k[0, :7].tolist() == [[t, -t] for t in range(7)]
    assert k[1, :9].tolist() == [[t, -t] for t in range(7, 16)]
    assert np.isnan(pages[bp.NULL_BLOCK]).all() and not (jnp.abs(pages) == 16).any()


def test_failed_append_changes_nothing():
    table, pool = fresh(num_blocks=4)  # 3 usable
    table, pool, ok = append(table, pool, {0: 5})
    assert ok
    for request in ({1: 5, 2: 1}, {0: 12}, {0: -1}):  # out of blocks, outgrows its row, negative
        after = append(table, pool, request)
        assert not after[2]
        assert_same(after[:2], (table, pool))
    after = pt.append_tokens(table, pool, jnp.array([1, 1]), jnp.array([1, 1]))  # a row twice
    assert not after[2]
    assert_same(after[:2], (table, pool))
    table, pool = fresh()
    after = append(table, pool, {0: 5}, max_new_blocks=1)  # more blocks than the bound
    assert not after[2]
    assert_same(after[:2], (table, pool))


def test_release_returns_every_block():
    table, pool = fresh()
    table, pool, ok = append(table, pool, {0: 5, 1: 16, 3: 1})
    assert ok and int(pool.num_free) == NUM_BLOCKS - 1 - 7
    table, pool, ok = pt.release(table, pool, jnp.array([3, -1, 0, 1]))
    assert ok
    assert int(pool.num_free) == NUM_BLOCKS - 1
    assert (np.asarray(pool.refcounts) == 0).all()
    assert_same(table, fresh()[0])
    _, pool_again, ok = pt.release(table, pool, jnp.array([0, 0]))  # a row twice
    assert not ok
    assert_same(pool_again, pool)


def test_fork_shares_blocks_and_unshare_copies_only_partial_last_blocks():
    table, pool = fresh()
    table, pool, _ = append(table, pool, {0: 10})  # 2 full blocks and a partial one
    table, pool, ok = pt.fork(table, pool, jnp.array(0), jnp.array([1, 2, -1]))
    assert ok
    prompt = np.asarray(table.block_tables)[0, :3].tolist()
    assert (np.asarray(table.block_tables)[:3, :3] == prompt).all()
    assert int(bp.num_in_use(pool)) == 3 and np.asarray(pool.refcounts)[prompt].tolist() == [3, 3, 3]
    assert not pt.fork(table, pool, jnp.array(0), jnp.array([1]))[2]  # row 1 is not empty

    table, pool, copies, ok = pt.unshare_last_blocks(table, pool, jnp.array([0, 1, 2, -1]))
    assert ok
    rows = np.asarray(table.block_tables)
    assert rows[2, 2] == prompt[2], "the last reference keeps the original"
    assert np.asarray(copies).tolist() == [[prompt[2], rows[0, 2]], [prompt[2], rows[1, 2]], [-1, -1], [-1, -1]]
    assert len({rows[0, 2], rows[1, 2], prompt[2]}) == 3
    assert (rows[:3, :2] == prompt[:2]).all()
    check_table(table, pool)

    table, pool, _ = append(table, pool, {0: 2, 1: 2})  # rows 0 and 1 now end on a full block
    table, pool, _ = pt.fork(table, pool, jnp.array(0), jnp.array([3]))
    _, after, copies, ok = pt.unshare_last_blocks(table, pool, jnp.array([0, 3]))
    assert ok and (np.asarray(copies) == -1).all()
    assert_same(after, pool)

    _, pool, ok = pt.release(table, pool, jnp.arange(MAX_SEQS))
    assert ok and int(pool.num_free) == NUM_BLOCKS - 1


def test_append_and_release_under_vmap_and_jit():
    lanes = [fresh() for _ in range(3)]
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *lanes)
    seq_ids = jnp.array([[0, 1], [1, -1], [0, 1]])
    counts = jnp.array([[5, 9], [3, 0], [40, 1]])  # the last lane outgrows its row and fails
    out = jax.vmap(pt.append_tokens)(*batch, seq_ids, counts)
    expected = [pt.append_tokens(*lane, s, c) for lane, s, c in zip(lanes, seq_ids, counts)]
    assert_same(out, jax.tree.map(lambda *xs: jnp.stack(xs), *expected))
    assert np.asarray(out[2]).tolist() == [True, True, False]

    @jax.jit
    def step(table, pool):
        table, pool, ok = pt.append_tokens(table, pool, jnp.array([2]), jnp.array([6]), max_new_blocks=2)
        slots = pt.slot_mapping(table, jnp.array([2, 2]), jnp.array([0, 5]))
        table, pool, released = pt.release(table, pool, jnp.array([2]))
        return slots, pool, ok & released

    slots, pool, ok = step(*fresh())
    assert ok and int(pool.num_free) == NUM_BLOCKS - 1
    assert np.asarray(slots).tolist() == [1 * BLOCK_SIZE + 0, 2 * BLOCK_SIZE + 1]
