"""The whole engine under a random client, as a hypothesis state machine on a tiny random model.

Rules add requests (prompts that often share a prefix; greedy, sampled, n samples, beam search, stop
strings and stop ids, penalties, logprobs, min_tokens), add requests the engine must refuse, abort
requests, step, and inject a fault into a step. The pool holds two long sequences at most, so
preemption is routine in both modes, and half the examples run a step ahead (async scheduling), so
aborts, preemptions, stops and faults meet a step in flight.

After every step: the pool's reference counts are exactly the references that live sequences and the
prefix cache hold, every unfinished request still has a sequence queued or running, and a finished
request has its n completions, each within max_tokens. At the end the engine drains, and once the
prefix cache lets go every block is free.
"""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from conftest import fail_in_xla, fail_on_host
from models import load_model, load_tokenizer
from paged_jax import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from paged_jax.core.sampling_params import RequestOutputKind
from paged_jax.core.sequence import Status

BLOCK_SIZE = 4
# At most 8 blocks a sequence, in a pool of 13: two long sequences fill it. Short sequences and a
# 16-token step keep the compiled shapes few (one block-table width, one token bucket).
MAX_MODEL_LEN = 32
NUM_BLOCKS = 14
MAX_NUM_BATCHED_TOKENS = 16
# A drain that takes longer than this is stuck: the longest workload needs a few hundred steps.
MAX_DRAIN_STEPS = 500
# Derandomized, so CI runs the same 100 examples each time: about a minute on the 2-core development
# machine (half of it compiling, when the compilation cache is cold). Without the copy-on-write
# reservation the 11th example fails.
SETTINGS = settings(max_examples=100, stateful_step_count=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

VOCAB = 320  # conftest's tiny models
_rng = np.random.default_rng(8)
# Prompts open with one of these, so prefix-cache blocks are shared, matched and evicted.
PREFIXES = ((), tuple(_rng.integers(0, VOCAB, 8).tolist()), tuple(_rng.integers(0, VOCAB, 13).tolist()))
# Pieces that SmolLM2's tokenizer decodes many of the first 320 ids to, so stop strings do hit.
STOP_STRINGS = ("e", "er", " t", "A", "in")
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind
PENALTIES = ({}, dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.5))

PROMPTS = st.builds(lambda prefix, tail: [*prefix, *tail], st.sampled_from(PREFIXES),
                    st.lists(st.integers(0, VOCAB - 1), max_size=12)).filter(len)


@st.composite
def sampling_params(draw) -> SamplingParams:
    kind = draw(st.sampled_from(["greedy", "sampled", "beam"]))
    max_tokens = draw(st.integers(1, 12))
    common = dict(max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
                  stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                  ignore_eos=draw(st.booleans()), logprobs=draw(st.none() | st.integers(0, 5)),
                  **draw(st.sampled_from(PENALTIES)))
    if kind == "beam":  # whose beams have no deltas
        return SamplingParams(n=draw(st.integers(2, 4)), use_beam_search=True, temperature=0.0,
                              output_kind=draw(st.sampled_from([CUMULATIVE, FINAL_ONLY])), **common)
    stop = draw(st.lists(st.sampled_from(STOP_STRINGS), max_size=2))
    common["output_kind"] = draw(st.sampled_from(RequestOutputKind))
    if kind == "greedy":
        return SamplingParams(temperature=0.0, stop=stop, **common)
    return SamplingParams(n=draw(st.integers(1, 4)), temperature=draw(st.sampled_from([0.7, 1.0])),
                          seed=draw(st.none() | st.integers(0, 2**31 - 1)), stop=stop, **common)


# Requests add_request must refuse: (prompt, params).
REFUSED = (
    ([], SamplingParams()),
    ([VOCAB], SamplingParams()),
    (list(range(MAX_MODEL_LEN)), SamplingParams()),
    ([5, 6], SamplingParams(n=2, use_beam_search=True, temperature=0.0, stop=["e"])),
)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self, loaded, tokenizer, seen: collections.Counter):
        super().__init__()
        self.loaded, self.tokenizer = loaded, tokenizer
        self.seen = seen  # what the run exercised, over all examples
        self.live: dict[str, SamplingParams] = {}  # accepted requests with no finished output yet
        self.deltas: dict[str, RequestOutput] = {}  # DELTA requests' outputs so far, folded together
        self.greedy_done: list[tuple[list[int], list[int]]] = []  # (prompt, tokens) of finished greedy requests
        self.fault: str | None = None  # where the last injected fault was, once one was

    # Every example opens with a workload: left to rules alone, most examples would add nothing.
    @initialize(mode=st.sampled_from(["recompute", "swap"]), prefix_caching=st.booleans(),
                async_scheduling=st.booleans(),
                requests=st.lists(st.tuples(PROMPTS, sampling_params()), min_size=1, max_size=8))
    def start(self, mode, prefix_caching, async_scheduling, requests):
        config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN,
                              max_num_seqs=8, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                              preemption_mode=mode, enable_prefix_caching=prefix_caching,
                              async_scheduling=async_scheduling)
        self.engine = LLMEngine(self.loaded.model, self.loaded.config, self.tokenizer, config)
        self.mode = mode
        self.seen[f"examples in {mode} mode"] += 1
        self.seen[f"examples with async scheduling {'on' if async_scheduling else 'off'}"] += 1
        for prompt, params in requests:
            self.add(prompt, params)

    @rule(prompt=PROMPTS, params=sampling_params())
    def add(self, prompt, params):
        self.live[self.engine.add_request(prompt, params)] = params

    @precondition(lambda self: self.greedy_done)
    @rule(data=st.data())
    def add_stopping_on_a_seen_token(self, data):
        """A stop id the model does produce (a random one it seldom would): a token that greedy decoding
        of this prompt gave before."""
        prompt, tokens = data.draw(st.sampled_from(self.greedy_done))
        self.add(prompt, SamplingParams(temperature=0.0, max_tokens=len(tokens), stop_token_ids=[tokens[-1]]))

    @rule(refused=st.sampled_from(REFUSED))
    def add_refused(self, refused):
        pending = self.engine.num_unfinished_requests
        with pytest.raises(ValueError):
            self.engine.add_request(*refused)
        assert self.engine.num_unfinished_requests == pending

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort_request(request_id)
        del self.live[request_id]
        self.deltas.pop(request_id, None)

    @rule(steps=st.integers(1, 8))
    def step(self, steps):
        for _ in range(steps):
            self._step()

    @rule(in_xla=st.booleans())
    def failing_step(self, in_xla):
        """A step that fails, on the host or inside XLA (taking the KV cache): the requests in it end
        with an error, their blocks freed, and the others go on. A step a step ahead of the host
        (async scheduling) fails inside XLA after its dispatch returned: that shows, with the fault's
        own error, when the next step reads it."""
        runner = self.engine.runner
        # An instance attribute, over the method, for this one step.
        runner.dispatch = (lambda *args: fail_in_xla(runner.kv_cache)) if in_xla else fail_on_host
        self.fault = "in XLA" if in_xla else "on the host"
        try:
            outputs = self.engine.step()
        finally:
            del runner.dispatch
        for output in outputs:
            self._take(output)
        self.references_match_holders()

    def _step(self):
        for output in self.engine.step():
            self._take(output)
        self.references_match_holders()

    def _take(self, output: RequestOutput):
        """Check an output and fold it into what the machine knows."""
        if output.error is not None:
            assert self.fault is not None, f"an output with an error, with no fault injected: {output.error}"
            assert output.finished and "injected fault" in output.error
            assert {c.finish_reason for c in output.outputs} == {"error"}
            del self.live[output.request_id]
            self.deltas.pop(output.request_id, None)
            self.seen[f"requests ended by a fault {self.fault}"] += 1
            return
        params = self.live[output.request_id]  # never an unknown, aborted or already finished request
        assert output.finished or params.output_kind is not FINAL_ONLY
        if params.output_kind is DELTA:
            if output.request_id in self.deltas:
                self.deltas[output.request_id].add(output)
            output = self.deltas.setdefault(output.request_id, output)
        if output.finished:
            self._check_finished(output, params)
            if params.temperature == 0 and params.n == 1 and output.outputs[0].token_ids:
                self.greedy_done.append((output.prompt_token_ids, list(output.outputs[0].token_ids)))
            del self.live[output.request_id]
            kind = "beam search" if params.use_beam_search else "n > 1" if params.n > 1 else "n = 1"
            self.seen[f"{kind} finished"] += 1
            self.seen[f"{params.output_kind.name} output finished"] += 1
            self.seen[f"{kind} finished after a preemption"] += output.metrics.num_preemptions > 0
            self.seen.update(f"{c.finish_reason} {type(c.stop_reason).__name__}" for c in output.outputs)

    def _check_finished(self, output, params: SamplingParams):
        """Whole outputs (DELTA ones folded together) hold the n completions, each within its limits
        and with the text a full decode of its tokens gives, cut at its stop string."""
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            if isinstance(completion.stop_reason, str):
                text = text[: text.find(completion.stop_reason)]
            assert completion.text == text
            n = len(completion.token_ids)
            assert completion.finish_reason in ("stop", "length"), completion
            assert n <= params.max_tokens
            if completion.finish_reason == "length":
                assert n == params.max_tokens or len(output.prompt_token_ids) + n == MAX_MODEL_LEN
            else:
                assert n >= params.min_tokens
            if params.logprobs is not None and not params.use_beam_search:
                assert len(completion.logprobs) == n

    @invariant()
    def references_match_holders(self):
        scheduler, blocks = self.engine.scheduler, self.engine.blocks
        live = [*scheduler.running, *scheduler.waiting]
        assert len({id(s) for s in live}) == len(live), "a sequence is queued twice"
        assert all(s.status is Status.RUNNING for s in scheduler.running)
        assert all(s.status is Status.WAITING for s in scheduler.waiting)
        held = collections.Counter(b for s in live for b in s.block_ids)
        if blocks.cache is not None:
            held.update(blocks.cache.cached_ids())
        blocks.commit()  # the pool of record follows the host's bookkeeping at each step's commit
        blocks.check()
        refcounts = np.asarray(blocks.pool.refcounts)
        assert held == collections.Counter({b: int(c) for b, c in enumerate(refcounts) if c})
        assert int(blocks.pool.num_free) == np.count_nonzero(refcounts[1:] == 0)
        # The scheduler reads the manager's host copy of the counts, kept without reading the pool back.
        np.testing.assert_array_equal(blocks.refcounts, refcounts)
        assert blocks.num_free == int(blocks.pool.num_free)
        assert set(self.live) <= {s.request_id for s in live}, "an unfinished request has nothing left to run"

    def _queues(self) -> str:
        scheduler = self.engine.scheduler
        describe = lambda s: (f"{s.request_id}/{s.index}: {s.num_computed_tokens}/{s.num_tokens} computed, "
                              f"{len(s.block_ids)} blocks, {self.live[s.request_id]}")
        return "\n".join(["running:", *map(describe, scheduler.running), "waiting:",
                          *map(describe, scheduler.waiting), f"free blocks: {self.engine.blocks.num_free}"])

    def teardown(self):
        for _ in range(MAX_DRAIN_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self._step()
        assert not self.engine.has_unfinished_requests(), f"stuck after {MAX_DRAIN_STEPS} steps: {self._queues()}"
        assert not self.live
        self.engine.blocks.reset_prefix_cache()
        assert self.engine.blocks.num_free == NUM_BLOCKS - 1
        self.seen[f"preemptions by {self.mode}"] += self.engine.stats().num_preemptions


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_checkpoint):
    """The SmolLM2-shaped tiny model, and SmolLM2's tokenizer, which decodes its 320 ids to text."""
    folder, _ = tiny_checkpoint("smollm2")
    return load_model(folder), load_tokenizer("smollm2-135m")


def test_engine_survives_a_random_client(tiny_with_tokenizer):
    seen = collections.Counter()
    run_state_machine_as_test(lambda: EngineMachine(*tiny_with_tokenizer, seen), settings=SETTINGS)
    print(dict(seen))
    for what in ("preemptions by recompute", "preemptions by swap", "n > 1 finished after a preemption",
                 "beam search finished after a preemption", "stop str", "stop int",
                 "requests ended by a fault on the host", "requests ended by a fault in XLA",
                 "DELTA output finished", "FINAL_ONLY output finished", "examples with async scheduling on"):
        assert seen[what] > 0, f"the run never saw {what}: {dict(seen)}"
