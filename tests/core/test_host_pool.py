"""The NumPy block pool against the jitted one: random operation sequences, failing ones included,
give equal pools, ids, copies and ok flags after every call, and never modify the pool passed in."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_jax.core import block_pool as bp
from paged_jax.core import host_pool as hp

NUM_BLOCKS = 10  # 9 usable: random runs exhaust the pool and wrap its free queue
MAX_N = 6
K = 8  # fixed length of every id vector, so each jitted op compiles once


def assert_equal(expected, actual):
    for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def snapshot(pool):
    return [np.array(leaf) for leaf in jax.tree.leaves(pool)]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_random_operations_match_the_jitted_pool(data):
    jitted, host = bp.init_pool(NUM_BLOCKS), hp.init_pool(NUM_BLOCKS)
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["allocate", "free", "share", "copy_on_write"]), label="op")
        before = snapshot(host)
        if op == "allocate":
            n = data.draw(st.integers(-1, MAX_N + 1), label="n")
            expected, actual = bp.allocate(jitted, n, MAX_N), hp.allocate(host, n, MAX_N)
        else:
            # Mostly references held (a valid call), sometimes any id: padding, the null block, a free
            # block, one past the end, or more entries of a block than it has references.
            held = np.repeat(np.arange(NUM_BLOCKS), host.refcounts).tolist()
            if held and data.draw(st.booleans(), label="valid"):
                chosen = data.draw(st.lists(st.sampled_from(range(len(held))), unique=True, max_size=K))
                ids = [held[i] for i in chosen]
            else:
                ids = data.draw(st.lists(st.integers(-1, NUM_BLOCKS), max_size=K), label="ids")
            ids = np.array(ids + [-1] * (K - len(ids)), np.int32)
            expected, actual = getattr(bp, op)(jitted, ids), getattr(hp, op)(host, ids)
        assert_equal(expected, actual)
        assert_equal(before, snapshot(host))  # the pool passed in is left as it was
        jitted, host = expected[0], actual[0]


def test_init_pool_refuses_a_pool_without_a_usable_block():
    with pytest.raises(ValueError, match="at least 2"):
        hp.init_pool(1)
