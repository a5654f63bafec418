"""The scheduler on its own, driven as the engine drives it but without a model: admission order and
limits, the token budget of chunked prefill, preemption (recompute and swap), prefix sharing and forks.
After every step each block's reference count is what the running sequences and the prefix cache hold,
and at the end the pool is all free."""

import collections
import dataclasses

import numpy as np
import pytest

from paged_jax.core.block_manager import BlockManager
from paged_jax.core.config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler, SchedulerOutput
from paged_jax.core.sequence import Sequence, Status

BS = 4


class FakeSwapper:
    """Host memory for swapped blocks: each swap-out saves the ids it was given, under a number of its own."""

    def __init__(self):
        self.swapped_out, self.swapped_in = [], []

    def swap_out(self, block_ids):
        saved = (len(self.swapped_out), tuple(block_ids))
        self.swapped_out.append(saved)
        return saved

    def swap_in(self, saved, block_ids):
        assert len(saved[1]) == len(block_ids)  # as many fresh blocks as were saved
        self.swapped_in.append(saved)


@dataclasses.dataclass
class Harness:
    scheduler: Scheduler
    max_tokens: int
    finished: list = dataclasses.field(default_factory=list)
    _ids: int = 0

    def add(self, prompt_len: int, *, first: int = 0, priority: int = 0, n: int = 1, tokens=None) -> Sequence:
        tokens = list(range(first, first + prompt_len)) if tokens is None else list(tokens)
        seq = Sequence(seq_id=self._ids, request_id=str(self._ids), token_ids=tokens, num_prompt_tokens=len(tokens),
                       params=SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0), seed=0,
                       arrival_time=float(self._ids), priority=priority, forks=n)
        self._ids += n  # a request with n samples reserves n ids for its forks
        self.scheduler.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        """One engine step: the scheduled tokens are computed, a sampling sequence gets a token (its
        own: forks diverge), one at max_tokens finishes."""
        out = self.scheduler.schedule()
        assert out.num_tokens <= self.scheduler.config.max_num_batched_tokens
        samples = [s.samples for s in out.scheduled]
        for s, sampled in zip(out.scheduled, samples):
            s.seq.num_computed_tokens += s.num_new_tokens
            if sampled:
                s.seq.token_ids.append(1000 * s.seq.seq_id + s.seq.num_tokens)
                if s.seq.num_output_tokens >= self.max_tokens:
                    self.scheduler.finish(s.seq)
                    self.finished.append(s.seq)
        check_blocks(self.scheduler)
        return out

    def run(self, max_steps: int = 500) -> list[SchedulerOutput]:
        outs = []
        while self.scheduler.has_unfinished():
            assert len(outs) < max_steps, "the scheduler is stuck"
            outs.append(self.step())
        return outs


def harness(num_blocks: int = 64, max_tokens: int = 4, **options) -> Harness:
    config = EngineConfig(**options)
    blocks = BlockManager(num_blocks, BS, config.enable_prefix_caching, functional_pool=False)
    return Harness(Scheduler(config, blocks, swapper=FakeSwapper()), max_tokens)


def check_blocks(scheduler: Scheduler) -> None:
    """Every block's references are those of the running sequences and the prefix cache, and each
    running sequence has a block for every token it has computed."""
    blocks = scheduler.blocks
    held = collections.Counter(b for s in scheduler.running for b in s.block_ids)
    if blocks.cache is not None:
        held.update(blocks.cache.cached_ids())
    refcounts = blocks.refcounts
    assert {int(b): int(refcounts[b]) for b in np.flatnonzero(refcounts)} == dict(held)
    assert blocks.num_free == blocks.num_blocks - 1 - np.count_nonzero(refcounts)
    for s in scheduler.running:
        assert s.status is Status.RUNNING and len(s.block_ids) >= -(-s.num_computed_tokens // BS)
    for s in scheduler.waiting:
        assert s.status is Status.WAITING and s.block_ids == []


def assert_all_free(h: Harness) -> None:
    assert not h.scheduler.has_unfinished()
    h.scheduler.blocks.reset_prefix_cache()
    assert h.scheduler.blocks.num_free == h.scheduler.blocks.num_blocks - 1
    assert not h.scheduler.blocks.refcounts.any()


def test_fcfs_admits_in_arrival_order_up_to_max_num_seqs():
    h = harness(max_num_seqs=2)
    seqs = [h.add(5, first=10 * i) for i in range(3)]
    out = h.step()
    assert [s.seq for s in out.scheduled] == seqs[:2] and list(h.scheduler.waiting) == seqs[2:]
    h.run()
    assert h.finished[:2] == seqs[:2] and h.finished[2] is seqs[2]
    assert_all_free(h)


def test_priority_admits_lower_values_first():
    h = harness(max_num_seqs=1, scheduling_policy="priority")
    seqs = [h.add(3, first=10 * i, priority=p) for i, p in enumerate((2, 0, 1, 0))]
    h.run()
    assert h.finished == [seqs[1], seqs[3], seqs[2], seqs[0]]
    assert_all_free(h)


def test_chunked_prefill_splits_a_prompt_over_the_budget_and_serves_decodes_first():
    h = harness(max_num_batched_tokens=16, max_tokens=8)
    decoding = h.add(3)
    h.step()  # its prompt, then it decodes one token a step
    long = h.add(40, first=100)
    chunks = []
    while long.num_output_tokens == 0:
        out = h.step()
        assert out.scheduled[0].seq is decoding and out.scheduled[0].num_new_tokens == 1
        chunks += [s.num_new_tokens for s in out.scheduled if s.seq is long]
        assert out.num_tokens <= 16
    assert chunks == [15, 15, 10]
    h.run()
    assert_all_free(h)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room_for_all_of_it():
    h = harness(max_num_batched_tokens=16, enable_chunked_prefill=False, max_tokens=3)
    first, second = h.add(10), h.add(10, first=50)
    out = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(first, 10)]
    out = h.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(first, 1), (second, 10)]
    h.run()
    assert_all_free(h)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_short_pool_preempts_the_latest_admitted_and_every_sequence_finishes(mode):
    # 6 usable blocks of 4; three sequences growing to 6 + 8 tokens need 4 blocks each.
    h = harness(num_blocks=7, max_tokens=8, preemption_mode=mode, enable_prefix_caching=False)
    seqs = [h.add(6, first=10 * i) for i in range(3)]
    outs = h.run()
    preempted = [victim for out in outs for victim in out.preempted]
    assert preempted, "the pool never ran short"
    admitted = [s.seq for s in outs[0].scheduled]
    assert preempted[0] is admitted[-1]  # FCFS: the newest gives way
    assert sorted(s.seq_id for s in h.finished) == [s.seq_id for s in seqs]
    assert all(s.num_output_tokens == 8 for s in seqs) and h.scheduler.num_preemptions == len(preempted)
    swapper = h.scheduler.swapper
    if mode == "swap":
        assert swapper.swapped_out and sorted(swapper.swapped_in) == swapper.swapped_out  # each back once
    else:
        assert not swapper.swapped_out
    assert_all_free(h)


def test_a_preempted_sequence_waits_at_the_head_and_resumes_where_it_may():
    h = harness(num_blocks=7, max_tokens=8, preemption_mode="swap", enable_prefix_caching=False)
    for i in range(4):  # three fill the pool; the fourth waits
        h.add(6, first=10 * i)
    while not (out := h.step()).preempted:
        pass
    victim = out.preempted[0]
    # Ahead of the one that never ran: under FCFS, the earlier arrival goes first.
    assert list(h.scheduler.waiting)[:2] == [victim, h.scheduler.waiting[-1]] and h.scheduler.waiting[-1].seq_id == 3
    assert victim.block_ids == [] and victim.swapped_kv is not None
    computed = victim.num_computed_tokens
    assert computed > 0  # swapped: its computed tokens are kept
    while victim.status is not Status.RUNNING:
        h.step()
    assert victim.swapped_kv is None and victim.num_computed_tokens >= computed
    h.run()
    assert_all_free(h)


def test_a_recomputed_sequence_starts_again_from_its_first_token():
    h = harness(num_blocks=7, max_tokens=8, enable_prefix_caching=False)
    for i in range(3):
        h.add(6, first=10 * i)
    while not (out := h.step()).preempted:
        pass
    victim = out.preempted[0]
    assert victim.num_computed_tokens == 0 and victim.num_preemptions == 1
    num_tokens = victim.num_tokens
    readmitted = None
    while readmitted is None:
        readmitted = next((s for s in h.step().scheduled if s.seq is victim), None)
    assert readmitted.num_new_tokens == num_tokens  # prompt and generated tokens, all again
    h.run()
    assert_all_free(h)


def test_a_cached_prefix_is_shared_at_admission():
    h = harness(max_tokens=2)
    shared = list(range(100, 108))  # two full blocks
    first = h.add(0, tokens=shared + [1, 2, 3])
    h.step()
    first_blocks = list(first.block_ids)
    second = h.add(0, tokens=shared + [7])
    out = h.step()
    (scheduled,) = [s for s in out.scheduled if s.seq is second]
    assert scheduled.num_new_tokens == 1 and second.num_prefix_hit_tokens == 8
    assert second.block_ids[:2] == first_blocks[:2]
    h.run()
    assert_all_free(h)


def test_admission_does_not_count_on_evicting_the_prefix_it_shares():
    """The cached prefix a request is about to share is not room for its other blocks: it waits."""
    h = harness(num_blocks=7, max_tokens=4)  # 6 usable blocks of 4
    prefix = list(range(100, 108))
    h.add(0, tokens=prefix)
    h.run()  # leaves its two full blocks cached, held by the cache alone
    other = h.add(12, first=50)  # takes 3 of the 4 free blocks
    sharing = h.add(0, tokens=prefix + list(range(8)))  # needs its 2 cached blocks and 2 more
    out = h.step()
    assert [s.seq for s in out.scheduled] == [other] and h.scheduler.waiting[0] is sharing
    h.run()
    assert sharing.num_prefix_hit_tokens == 8
    assert_all_free(h)


def test_samples_fork_once_the_prompt_is_computed_and_copy_the_block_they_write():
    h = harness(max_tokens=3)
    parent = h.add(6, n=3)
    out = h.step()
    assert out.scheduled[0].num_new_tokens == 5 and not out.forked  # all but the last token
    out = h.step()
    assert [c.index for c in out.forked] == [1, 2]
    # The full block stays shared; the last prompt token lands in the shared partial block, so each
    # writer but the last gets a copy of it.
    assert all(c.block_ids[0] == parent.block_ids[0] for c in out.forked)
    assert len(out.copies) == 2 and len({s.seq.block_ids[1] for s in out.scheduled}) == 3
    h.run()
    assert len(h.finished) == 3
    assert_all_free(h)


def test_finishing_or_aborting_a_waiting_sequence_frees_nothing_it_does_not_hold():
    h = harness(max_num_seqs=1)
    running, waiting = h.add(5), h.add(5, first=20)
    h.step()
    h.scheduler.finish(waiting)
    assert waiting.status is Status.FINISHED and not h.scheduler.waiting
    check_blocks(h.scheduler)
    h.scheduler.finish(running)
    assert_all_free(h)
