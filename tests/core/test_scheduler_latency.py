"""Scheduling for latency on the real Scheduler and BlockManager, with a fake model: while sequences
decode, a step's prompt tokens are capped (long_prefill_token_threshold), at most
max_num_partial_prefills prompts are part-way at once, a step never holds more than max_num_seqs
sequences, and every prompt still finishes."""

import pytest

from paged_jax import EngineConfig, SamplingParams
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.scheduler import Scheduler, SchedulerOutput
from paged_jax.core.sequence import Sequence
from paged_jax.core.step_budget import BACKLOG, STEP_OVERHEAD_TOKENS, fit_bucket


def make_seq(seq_id: int, prompt_len: int, max_tokens: int, **params) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=list(range(1000 * seq_id, 1000 * seq_id + prompt_len)),
                    num_prompt_tokens=prompt_len, params=SamplingParams(max_tokens=max_tokens, **params), seed=0,
                    arrival_time=float(seq_id))


def run_step(scheduler: Scheduler, out: SchedulerOutput) -> list[Sequence]:
    """What the engine does after the model: advance each sequence, sample a token where the step
    reaches its last known one, retire those at their max_tokens. Returns the retired."""
    done = []
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.token_ids.append(7)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                scheduler.finish(s.seq)
                done.append(s.seq)
    return done


def prompt_tokens(out: SchedulerOutput) -> int:
    return sum(s.num_new_tokens for s in out.scheduled if s.seq.num_computable_tokens - s.seq.num_computed_tokens > 1)


def decodes(out: SchedulerOutput) -> int:
    return sum(s.seq.num_computable_tokens - s.seq.num_computed_tokens == 1 for s in out.scheduled)


def scheduler_for(**options) -> Scheduler:
    config = EngineConfig(**dict(block_size=16, max_num_batched_tokens=512) | options)
    return Scheduler(config, BlockManager(4096, 16, enable_prefix_caching=False, functional_pool=False))


def decoding(num_seqs: int, **options) -> Scheduler:
    """A scheduler (scheduler_for's) with num_seqs short requests decoding, their prompts done in one step."""
    scheduler = scheduler_for(**options)
    for i in range(num_seqs):
        scheduler.add(make_seq(i, 20, max_tokens=1000))
    run_step(scheduler, scheduler.schedule())
    return scheduler


@pytest.mark.parametrize("threshold", [64, 128])
def test_a_long_prompt_beside_decodes_comes_in_small_steps_and_finishes(threshold):
    scheduler = decoding(4, long_prefill_token_threshold=threshold)
    long = make_seq(9, 1500, max_tokens=1)
    scheduler.add(long)
    steps = 0
    while long.status.name != "FINISHED":
        out = scheduler.schedule()
        assert decodes(out) == 4, "the decodes run every step"
        # The step's tokens stay at the threshold: the prompt fills what the decodes leave, or takes
        # all it has left when that is less over than a step of its own would cost.
        left = long.num_computable_tokens - long.num_computed_tokens
        assert prompt_tokens(out) == (left if left <= threshold - 4 + STEP_OVERHEAD_TOKENS + 4 else threshold - 4)
        run_step(scheduler, out)
        steps += 1
    assert steps == (1500 - STEP_OVERHEAD_TOKENS - 5) // (threshold - 4) + 1


def test_a_prompt_just_over_the_cap_finishes_in_one_step():
    """W1 at 1 request/s: a 511-token prompt beside 4 decodes, cut at 508, waited a whole second step
    (with the next prompt in it) for its last 3 tokens."""
    scheduler = decoding(4, long_prefill_token_threshold=512, max_num_batched_tokens=1024)
    scheduler.add(make_seq(9, 511, max_tokens=4))
    out = scheduler.schedule()
    assert decodes(out) == 4 and prompt_tokens(out) == 511
    scheduler.add(make_seq(10, 600, max_tokens=4))
    run_step(scheduler, out)
    out = scheduler.schedule()
    assert decodes(out) == 5 and prompt_tokens(out) == 512 - 5, "well over the cap, a prompt is cut"


def test_a_long_prompt_waits_for_the_step_after_one_that_ends_another_prompt():
    """While sequences decode, a step that ends a prompt (its first token) takes no long prompt beside
    it: that prompt's tokens would delay the first token by more than the step of its own costs it."""
    scheduler = decoding(4, long_prefill_token_threshold=512, max_num_batched_tokens=1024)
    for i, length in enumerate((200, 250)):  # no backlog (BACKLOG): the cap holds
        scheduler.add(make_seq(10 + i, length, max_tokens=4))
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled if s.num_new_tokens > 1] == [(10, 200)]
    run_step(scheduler, out)
    scheduler.add(make_seq(12, 10, max_tokens=4))
    out = scheduler.schedule()  # 10 tokens delay one first token by less than a step: they join
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled if s.num_new_tokens > 1] == [(11, 250), (12, 10)]


def test_with_nothing_decoding_or_a_backlog_prompts_share_steps():
    for num_decoding, waiting in ((0, 3), (4, 9)):
        scheduler = decoding(num_decoding, long_prefill_token_threshold=512, max_num_batched_tokens=1024)
        for i in range(waiting):
            scheduler.add(make_seq(10 + i, 100, max_tokens=4))
        assert prompt_tokens(scheduler.schedule()) > 100


def test_nothing_decoding_leaves_the_whole_budget_to_prompts():
    scheduler = scheduler_for(long_prefill_token_threshold=64)
    for i in range(3):
        scheduler.add(make_seq(i, 300, max_tokens=4))
    out = scheduler.schedule()
    assert decodes(out) == 0 and prompt_tokens(out) == 512


def test_under_load_prompts_get_three_tokens_per_decode():
    scheduler = scheduler_for(long_prefill_token_threshold=64, max_num_seqs=64, max_num_batched_tokens=1024)
    for i in range(40):
        scheduler.add(make_seq(i, 8, max_tokens=1000))
    run_step(scheduler, scheduler.schedule())
    scheduler.add(make_seq(99, 600, max_tokens=1))
    out = scheduler.schedule()
    assert decodes(out) == 40 and prompt_tokens(out) == 120


def test_the_cap_is_off_at_zero_and_without_chunked_prefill():
    for options in (dict(long_prefill_token_threshold=0), dict(enable_chunked_prefill=False)):
        scheduler = scheduler_for(**options)
        scheduler.add(make_seq(0, 10, max_tokens=100))
        run_step(scheduler, scheduler.schedule())
        scheduler.add(make_seq(1, 400, max_tokens=1))
        assert prompt_tokens(scheduler.schedule()) == 400


@pytest.mark.parametrize("partial", [1, 2])
def test_at_most_max_num_partial_prefills_prompts_are_part_way(partial):
    scheduler = scheduler_for(max_num_partial_prefills=partial, max_num_batched_tokens=128)
    seqs = [make_seq(i, 300, max_tokens=2) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    finished = []
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        finished += run_step(scheduler, out)
        part_way = [s for s in scheduler.running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
        assert len(part_way) <= partial
    assert [s.seq_id for s in finished] == [0, 1, 2, 3, 4], "first come, first finished; none starves"


def test_a_short_prompt_that_fits_is_admitted_beside_a_part_way_one():
    scheduler = scheduler_for(max_num_partial_prefills=1, max_num_batched_tokens=128, long_prefill_token_threshold=0)
    scheduler.add(make_seq(0, 100, max_tokens=2))
    scheduler.add(make_seq(1, 500, max_tokens=2))
    scheduler.add(make_seq(2, 20, max_tokens=2))  # would be part-way too: waits
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 100), (1, 28)]


def test_a_step_never_holds_more_than_max_num_seqs_and_forks_all_run():
    scheduler = scheduler_for(max_num_seqs=4, max_num_batched_tokens=256)
    parents = [make_seq(10 * i, 12, max_tokens=6, temperature=1.0, n=3) for i in range(3)]
    for parent in parents:
        parent.forks = 3
        scheduler.add(parent)
    outputs = {}
    for _ in range(100):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        assert len(out.scheduled) <= 4
        for s in run_step(scheduler, out):
            outputs[s.seq_id] = s.num_output_tokens
    assert len(outputs) == 9 and set(outputs.values()) == {6}


def test_a_backlog_lifts_the_cap():
    scheduler = decoding(4, long_prefill_token_threshold=64, max_num_partial_prefills=4)
    for i in range(BACKLOG + 1):  # more than the backlog the cap allows
        scheduler.add(make_seq(10 + i, 300, max_tokens=1))
    out = scheduler.schedule()
    assert decodes(out) == 4 and prompt_tokens(out) == 512 - 4
    run_step(scheduler, out)
    while len(scheduler.waiting) > BACKLOG:
        run_step(scheduler, scheduler.schedule())
    assert scheduler.waiting and prompt_tokens(scheduler.schedule()) <= 64 - 4  # the cap is back


FINE = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # buckets.py's token buckets at 512 tokens


@pytest.mark.parametrize("before, num_new, after, then, fitted", [
    (0, 270, 0, None, 256),  # 14 tokens later against 114 of padding now
    (0, 330, 0, None, 330),  # 74 later would save only 54
    (0, 256, 0, None, 256),  # a bucket already
    (0, 10, 0, None, 10),  # under the smallest bucket: nothing to fill
    (4, 130, 2, None, 122),  # the decodes before and after count
    (130, 2, 0, None, 2),  # a cut would leave nothing
    (0, 270, 0, 0, 256),  # the prompt's end moves to a step of 16: 114 tokens of padding pay for it
    (4, 100, 0, None, 92),  # mid-prompt, 8 tokens move to save 24 of padding
    (4, 100, 0, 4, 100),  # but not the prompt's end: the step of 16 it would wait for costs more
])
def test_fit_bucket(before, num_new, after, then, fitted):
    assert fit_bucket(num_new, before, after, FINE, then) == fitted


def fitted_scheduler(**options) -> Scheduler:
    config = EngineConfig(**dict(block_size=16, max_num_batched_tokens=512) | options)
    return Scheduler(config, BlockManager(4096, 16, enable_prefix_caching=False, functional_pool=False), token_buckets=FINE)


def test_a_lone_prompt_fills_the_bucket_below_and_finishes_in_the_next_step():
    scheduler = fitted_scheduler()
    seq = make_seq(0, 270, max_tokens=2)
    scheduler.add(seq)
    steps = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        steps.append(out.num_tokens)
        run_step(scheduler, out)
    assert steps == [256, 14, 1]


def test_a_prompt_beside_decodes_fills_the_step_with_them():
    scheduler = fitted_scheduler(long_prefill_token_threshold=0)
    for i in range(3):
        scheduler.add(make_seq(i, 20, max_tokens=100))
    run_step(scheduler, scheduler.schedule())
    scheduler.add(make_seq(9, 140, max_tokens=2))
    out = scheduler.schedule()
    assert decodes(out) == 3 and prompt_tokens(out) == 128 - 3


def test_only_the_steps_last_prompt_chunk_is_cut():
    """Cutting the first of several prompts part-way would keep the second out of the step (one part-way
    prompt at a time): the step holds both, and the last is cut to fill a bucket."""
    scheduler = fitted_scheduler(max_num_partial_prefills=1)
    scheduler.add(make_seq(0, 100, max_tokens=2))
    scheduler.add(make_seq(1, 300, max_tokens=2))
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 100), (1, 284)]
