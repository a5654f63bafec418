"""snapshot.py on a tiny engine: a snapshot is a copy that agrees with the pool (the metrics' count of
used and cached blocks, reference counts, page tables) while prefixes are shared, samples forked,
sequences swapped out, and once everything has finished."""

import numpy as np
import pytest

from models.tiny import TINY_LLAMA, random_model
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.snapshot import CACHED, FREE, HELD, RESERVED, SHARED, block_states, num_used_blocks, pool_snapshot

BLOCK = 4
PREFIX = list(range(10, 22))  # three full blocks


@pytest.fixture(scope="module")
def model():
    return random_model()


def make_engine(model, **options) -> LLMEngine:
    return LLMEngine(model, TINY_LLAMA, None, EngineConfig(block_size=BLOCK, max_num_seqs=4, **options))


def check(engine: LLMEngine, snap: dict) -> np.ndarray:
    """Assert that the snapshot agrees with the engine's pool and queues now; returns the block states."""
    blocks, scheduler = engine.blocks, engine.scheduler
    state, refs, owner = block_states(snap)
    np.testing.assert_array_equal(snap["refcounts"], blocks.refcounts)
    assert state[0] == RESERVED and snap["block_size"] == BLOCK
    # What /metrics reports: usable blocks neither free nor held by the prefix cache alone.
    assert num_used_blocks(state) == blocks.num_blocks - 1 - blocks.num_free - blocks.num_evictable
    assert np.count_nonzero(state == CACHED) == blocks.num_evictable
    assert np.count_nonzero(state == FREE) == blocks.num_free
    seqs = [*scheduler.running, *scheduler.waiting]
    assert [s["seq_id"] for s in snap["seqs"]] == [s.seq_id for s in seqs]
    for seen, seq in zip(snap["seqs"], seqs):
        assert seen["block_ids"].tolist() == seq.block_ids
        held = len(seq.block_ids) + seen["num_swapped_blocks"]
        assert seen["num_computed_tokens"] <= held * BLOCK
        assert np.isin(state[seq.block_ids], (HELD, SHARED)).all()
    # A block's references are its holders' and, when it is named, the prefix cache's.
    np.testing.assert_array_equal(snap["refcounts"], refs + snap["cached"])
    assert (owner[state == SHARED] >= 0).all() and (refs[state == SHARED] >= 2).all()
    return state


def test_snapshots_agree_with_the_pool_and_are_copies(model):
    engine = make_engine(model, num_blocks=64)
    engine.add_request(PREFIX + [30, 31], SamplingParams(max_tokens=9, ignore_eos=True))
    engine.add_request(PREFIX + [40, 41, 42], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request([50, 51, 52, 53, 54, 55], SamplingParams(n=2, max_tokens=7, ignore_eos=True))
    first = pool_snapshot(engine)
    frozen = first["refcounts"].copy(), [s["block_ids"].copy() for s in first["seqs"]]
    shared_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        state = check(engine, pool_snapshot(engine))
        shared_seen += np.count_nonzero(state == SHARED)
    assert shared_seen > 0  # the common prefix, and the forked samples' prompt
    # The first snapshot did not move with the engine.
    np.testing.assert_array_equal(first["refcounts"], frozen[0])
    assert all((a == b).all() for a, b in zip((s["block_ids"] for s in first["seqs"]), frozen[1]))
    last = pool_snapshot(engine)
    state = check(engine, last)
    assert last["seqs"] == [] and num_used_blocks(state) == 0 and np.count_nonzero(state == CACHED) > 0


def test_swapped_sequences_show_their_blocks_on_the_host(model):
    engine = make_engine(model, num_blocks=12, preemption_mode="swap", max_num_batched_tokens=64)
    for i in range(3):
        engine.add_request(list(range(100 + 10 * i, 108 + 10 * i)), SamplingParams(max_tokens=16, ignore_eos=True))
    swapped = []
    while engine.has_unfinished_requests():
        engine.step()
        snap = pool_snapshot(engine)
        check(engine, snap)
        swapped += [s for s in snap["seqs"] if s["status"] == "swapped"]
    assert swapped, "the pool never ran short"
    for s in swapped:
        assert len(s["block_ids"]) == 0 and s["num_swapped_blocks"] == -(-s["num_computed_tokens"] // BLOCK) > 0
        assert s["num_preemptions"] >= 1
