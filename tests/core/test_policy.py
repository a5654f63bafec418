"""Scheduling policies: admission order and preemption victims on the real Scheduler and BlockManager,
and the same greedy tokens from the engine under every policy."""

import numpy as np
import pytest

from models import load_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.policy import POLICIES
from paged_jax.research.replay import Request, StepCost, replay
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Sequence
from paged_jax.serving.cli import parse_args

COST = StepCost(a=0.01, b=1e-4, c=1e-6)


def test_config_refuses_an_unknown_policy_and_serve_has_the_flag():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    assert parse_args(["--scheduling-policy", "priority"]).engine_config.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parse_args(["--scheduling-policy", "lifo"])


# (prompt length, priority), all arriving at once in this order; one sequence runs at a time.
QUEUE = [(30, 2), (10, 1), (20, 0), (5, 1)]
EXPECTED_ORDER = {
    "fcfs": [0, 1, 2, 3],
    "priority": [2, 1, 3, 0],  # lower first, ties by arrival
    "shortest_prompt_first": [3, 1, 2, 0],
}


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_are_served_in_the_policy_order(policy):
    requests = [Request(tuple(range(100 * i, 100 * i + n)), max_tokens=4, priority=p) for i, (n, p) in enumerate(QUEUE)]
    result = replay(EngineConfig(block_size=4, max_num_seqs=1, scheduling_policy=policy), 64, requests, COST)
    assert np.argsort(result.first_token_time).tolist() == EXPECTED_ORDER[policy]
    assert (result.num_output_tokens == 4).all() and result.num_preemptions == 0


def _seq(seq_id: int, prompt_len: int, priority: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id),
                    token_ids=list(range(1000 * seq_id, 1000 * seq_id + prompt_len)),
                    num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=8), seed=0,
                    arrival_time=float(seq_id), priority=priority)


@pytest.mark.parametrize("policy, victim", [("fcfs", 2), ("priority", 1), ("shortest_prompt_first", 0)])
def test_the_policy_picks_the_preemption_victim(policy, victim):
    """Three prompts fill the pool exactly (3 + 1 + 2 blocks of 4); the next token of each needs a
    block, so the first to grow preempts the last in the policy's order: the newest admitted, the
    lowest priority, the longest prompt."""
    blocks = BlockManager(num_blocks=7, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(EngineConfig(block_size=4, scheduling_policy=policy), blocks)
    seqs = [_seq(0, 12, 1), _seq(1, 4, 2), _seq(2, 8, 0)]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert len(first.scheduled) == 3 and blocks.num_free == 0
    for s in first.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.token_ids.append(7)
    second = scheduler.schedule()
    # The first victim is the policy's; under priority the runner-up (priority 1) then preempts
    # itself, as one freed block does not cover two growing sequences.
    assert second.preempted[0] is seqs[victim] and seqs[victim].block_ids == []
    assert set(scheduler.waiting) == set(second.preempted)
    assert {s.seq.seq_id for s in second.scheduled} == {0, 1, 2} - {s.seq_id for s in second.preempted}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    folder, _ = tiny_checkpoint("smollm2")
    return load_model(folder)


def make_engine(tiny, **options) -> LLMEngine:
    return LLMEngine(tiny.model, tiny.config, tiny.tokenizer, EngineConfig(**options))


def test_greedy_tokens_are_the_same_under_every_policy(tiny):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, tiny.config.vocab_size, size=int(n)).tolist() for n in rng.integers(2, 60, size=12)]
    priorities = rng.integers(0, 4, size=12).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for policy in POLICIES:
        # A pool this small preempts, so the victim choice runs too.
        engine = make_engine(tiny, block_size=8, num_blocks=24, max_num_batched_tokens=64, scheduling_policy=policy)
        priority = priorities if policy == "priority" else None
        results = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False, priority=priority)
        outputs[policy] = [o.outputs[0].token_ids for o in results]
        assert engine.stats().num_preemptions > 0
        engine.blocks.reset_prefix_cache()
        assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    assert outputs["priority"] == outputs["fcfs"] == outputs["shortest_prompt_first"]


def test_priority_runs_lower_values_first_and_other_policies_refuse_it(tiny):
    engine = make_engine(tiny, block_size=8, num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7], params, priority=p) for p in (3, 0, 2, 1)]
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [ids[1], ids[3], ids[2], ids[0]]

    fcfs = make_engine(tiny, block_size=8, num_blocks=64)
    with pytest.raises(ValueError, match="priority"):
        fcfs.add_request([5, 6, 7], params, priority=1)
    assert not fcfs.has_unfinished_requests()
    with pytest.raises(ValueError, match="priorities"):
        LLM.from_engine(engine).generate([[5, 6], [7, 8]], params, priority=[0])
