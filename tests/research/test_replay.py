"""replay.py: replaying each step on the pool of record (as the engine does) changes no decision of a replay."""

import dataclasses

import numpy as np
import pytest

from paged_jax.core.config import EngineConfig
from paged_jax.research.replay import Request, StepCost, replay

COST = StepCost(a=0.01, b=1e-4, c=1e-6)
BLOCK = 4


def requests() -> list[Request]:
    """16 requests over about a second; half open with one of two 12-token system prompts."""
    rng = np.random.default_rng(0)
    systems = [tuple(range(500, 512)), tuple(range(600, 612))]
    out = []
    for i in range(16):
        own = tuple(int(t) for t in rng.integers(1000, 2000, size=rng.integers(3, 20)))
        prompt = (systems[i % 2] + own) if i % 4 < 2 else own
        out.append(Request(prompt, max_tokens=int(rng.integers(2, 16)), arrival_time=i * 0.06, priority=i % 3))
    return out


# (engine options, blocks in the pool, whether the replay preempts, whether it hits the prefix cache)
@pytest.mark.parametrize("options, num_blocks, preempts, hits", [
    (dict(preemption_mode="recompute"), 14, True, True),
    (dict(preemption_mode="swap"), 14, True, False),  # a swapped-in sequence does not look up the cache
    (dict(preemption_mode="swap", enable_prefix_caching=False, scheduling_policy="priority"), 12, True, False),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, scheduling_policy="shortest_prompt_first"), 14,
     True, True),
    (dict(max_num_seqs=4, max_num_batched_tokens=16), 64, False, True),  # room to spare: the cache keeps blocks
])
def test_the_pool_of_record_follows_the_bookkeeping_through_a_replay(options, num_blocks, preempts, hits):
    """Each step replayed on the functional pool (one jitted call a step, which checks the blocks the
    host handed out against the pool's queue) changes no decision, and ends all free."""
    config = EngineConfig(block_size=BLOCK, **options)
    jitted = replay(config, num_blocks, requests(), COST, functional_pool=True)
    host = replay(config, num_blocks, requests(), COST)
    for field in dataclasses.fields(jitted):
        np.testing.assert_array_equal(getattr(host, field.name), getattr(jitted, field.name), err_msg=field.name)
    assert (host.num_preemptions > 0, host.prefix_hit_tokens > 0) == (preempts, hits)
