"""LLMEngine: requests in, incremental outputs out, one scheduling decision and one model call a step.

A server drives it from a background loop (add_request / abort_request from request handlers, step in
the loop); LLM (llm.py) drives it to completion for offline batches. What a front end may use is
`limits`, `add_request` (which checks everything and raises RequestError), `abort_request`,
`has_unfinished_requests` / `num_unfinished_requests`, `step`, `stats()`, `tokenizer` and `gate.compiler`
(structured outputs'); the scheduler, the block manager and the runner are the engine's own.
"""

import itertools
import logging
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

import models
from paged_jax.core import (beam_search, compilation_cache, distributed, engine_stats, multi_step, output_processor,
                            structured_output, validation)
from paged_jax.core.config import EngineConfig
from paged_jax.core.engine_parts import build_parts
from paged_jax.core.engine_stats import EngineStats
from paged_jax.core.errors import RequestError
from paged_jax.core.lora_request import LoRARequest
from paged_jax.core.outputs import RequestOutput
from paged_jax.core.request import Request, new_request
from paged_jax.core.resolve import default_device, default_dtype
from paged_jax.core.sampling import SamplerOutput
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from paged_jax.core.sequence import Sequence
from paged_jax.core.stop_checker import StopRules
from paged_jax.core.validation import EngineLimits

logger = logging.getLogger(__name__)

_MAX_SEED = 2**31 - 1

# Once, when the engine is imported, not by each engine built (compilation_cache.py).
compilation_cache.enable()


class _InFlight(NamedTuple):
    """A dispatched step: what it computes, the tokens each row samples, and its samples on the device
    (with a leading axis of steps when it ran several: multi_step.py)."""

    scheduled: list[ScheduledSeq]
    num_samples: list[int]
    sampled: SamplerOutput  # in a step with drafts, (SamplerOutput, accepted) (spec_decode/rejection.py)
    multi_step: bool
    drafts: list[int] | None = None  # a step with drafts: each scheduled sequence's number of them


class LLMEngine:
    def __init__(self, model, model_config, tokenizer, config: EngineConfig | None = None):
        """model: of an architecture in models.registry, on the default device, or already split over the
        engine's mesh (tensor_parallel_size > 1; engine_parts.py); tokenizer: a transformers tokenizer."""
        self.config = config or EngineConfig()
        parts = build_parts(model, model_config, self.config)
        self.model_config, self.resolved, self.adapters = parts.model_config, parts.resolved, parts.adapters
        self.runner, self.blocks, self.scheduler, self.speculator = (parts.runner, parts.blocks, parts.scheduler,
                                                                     parts.speculator)
        self.tokenizer = tokenizer
        self._in_flight: _InFlight | None = None  # the step dispatched and not yet read (async scheduling)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.gate = structured_output.GrammarGate(self.scheduler, tokenizer, self.model_config)  # for constrained requests
        self._stops = StopRules(self.eos_token_ids, self.resolved.max_model_len, self.gate.refusal)
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._seeds = itertools.count(self.config.seed * 1_000_003)
        self.peak_blocks_in_use, self.peak_slot_fill, self.num_batched_tokens = 0, 0.0, 0  # engine_stats.py

    @classmethod
    def from_pretrained(cls, model: str = models.DEFAULT_MODEL, config: EngineConfig | None = None,
                        **options) -> "LLMEngine":
        """Load `model` and build an engine from `config` or, without one, from EngineConfig's fields as keywords."""
        if config is not None and options:
            raise TypeError("give either an EngineConfig or its fields as keywords, not both")
        config = config or EngineConfig(**options)
        dtype = default_dtype(default_device().platform) if config.dtype == "auto" else config.dtype
        loaded = models.load_model(model, dtype=jnp.dtype(dtype), mesh=distributed.engine_mesh(config.tensor_parallel_size))
        return cls(loaded.model, loaded.config, loaded.tokenizer, config)

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(max_model_len=self.resolved.max_model_len, vocab_size=self.model_config.vocab_size,
                            max_num_seqs=self.config.max_num_seqs, scheduling_policy=self.config.scheduling_policy)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a prompt (text or token ids). Everything is checked here, never inside a step: a
        refused request raises RequestError (validation.py) and leaves the engine as it was.

        priority: under scheduling_policy "priority", lower runs first; any other policy refuses a
        priority other than 0 (as vLLM does), rather than silently ignoring it. arrival_time: when the
        request reached a front end (time.monotonic()), so that its metrics count the time it spent
        there; now when None. lora_request: the LoRA adapter to run with (enable_lora), read here if it is
        not in host memory."""
        params = params or SamplingParams()
        limits = self.limits
        validation.check_request(prompt, params, priority, limits, has_tokenizer=self.tokenizer is not None)
        if lora_request is not None:
            if self.adapters is None:
                raise RequestError("LoRA adapters are not enabled (enable_lora)", "lora_request")
            self.adapters.check(lora_request)
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        validation.check_prompt(token_ids, limits)
        seed = params.seed if params.seed is not None else next(self._seeds) % _MAX_SEED
        seq_id = next(self._seq_ids)
        # A request with n samples reserves n consecutive sequence ids for its forks.
        for _ in range(params.n - 1):
            next(self._seq_ids)
        request = self._requests[request_id] = new_request(
            request_id, prompt, token_ids, params, seq_id=seq_id, seed=seed, priority=priority, lora=lora_request,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time, tokenizer=self.tokenizer)
        self.gate.add(request.seqs[0])
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs for the requests that advanced (each as its
        SamplingParams.output_kind asks: a FINAL_ONLY request has one, when it finishes).

        Under asynchronous scheduling (EngineConfig.async_scheduling) the engine runs one step ahead: it
        dispatches the next model call before it reads the previous one's samples, so the host works while
        the device computes. A sequence whose token is still on the device is scheduled with a placeholder
        the device fills in (batch.py); a row computed after a token that ended it is dropped. Masks,
        beams and drafts need the tokens: while such sequences run, the previous samples are read first.

        If anything in a step fails (a bug, an input no check caught), step() does not raise: the error is
        logged, and the requests in the step (those it scheduled or read samples for; all that ran when
        scheduling itself failed) end at once, blocks freed, with finish_reason "error" and
        RequestOutput.error set. The others go on, computed again if the KV cache was lost.
        """
        refused = [out for seq, e in self.gate.admit() for out in self._fail([seq.request_id], self._requests, e)]
        requests = dict(self._requests)  # as they stood before the step, in case it fails
        start = time.monotonic()
        previous, self._in_flight = self._in_flight, None
        out = launched = None
        outputs = []
        try:
            if previous is not None and self._needs_tokens_first():
                outputs, previous = self._read(previous), None
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            out = self.scheduler.schedule(multi_step.num_steps(
                self.scheduler.running, self.scheduler.waiting and len(self.scheduler.running) < self.config.max_num_seqs,
                self.resolved.num_scheduler_steps))
            launched = self._launch(out, start)
            self.blocks.commit()
            if previous is not None:
                outputs, previous = outputs + self._read(previous), None
            if launched is not None and (not self.resolved.async_scheduling or launched.drafts is not None):
                outputs, launched = outputs + self._read(launched), None
            self._in_flight = launched
            return refused + outputs
        except Exception as error:
            logger.exception("an engine step failed; its requests end with an error")
            if previous is not None:  # a step that failed on the device shows in the next: it is the cause
                try:
                    self.runner.collect(previous.sampled)
                except Exception as cause:
                    error = cause
            seqs = [s.seq for flight in (previous, launched) if flight is not None for s in flight.scheduled]
            seqs += self.scheduler.running if out is None else [*(s.seq for s in out.scheduled), *out.forked]
            failed = list(dict.fromkeys(s.request_id for s in seqs))
            return refused + [o for o in outputs if o.request_id not in failed] + self._fail(failed, requests, error)

    def _needs_tokens_first(self) -> bool:
        """Whether the next schedule needs the in-flight tokens: a constrained row's mask follows from its
        last token, and beams are chosen from every sibling's proposals; drafts follow from every token."""
        if self.speculator is not None and self.speculator.active(self.scheduler.running):
            return True
        return any(s.guide is not None or s.params.use_beam_search for s in self.scheduler.running)

    def _fail(self, request_ids: list[str], requests: dict[str, Request], error: Exception) -> list[RequestOutput]:
        """End the given requests with an error, and leave the engine fit to serve the others."""
        now = time.monotonic()
        # Swept from the queues, not taken from the requests: a step that failed may have forked
        # samples that no request lists yet.
        for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.request_id in request_ids]:
            seq.finish_reason, seq.finish_time = "error", now
            self.scheduler.finish(seq)
        outputs = []
        for request in (requests[i] for i in request_ids if i in requests):
            self._requests.pop(request.request_id, None)
            outputs.append(output_processor.failed_output(request, error, now))
        if self.runner.restore_kv_cache():
            # The failure took every block's content with it: nothing computed may be read again.
            self.scheduler.recompute_all()
            self.blocks.reset_prefix_cache()
        return outputs

    def _launch(self, out: SchedulerOutput, start: float) -> "_InFlight | None":
        """Dispatch the scheduled step; the sequences it samples for have a token pending from then on."""
        scheduled, verified = out.scheduled, False
        if self.speculator is not None:
            scheduled, verified = self.speculator.fit(out.scheduled, [*self.scheduler.running, *out.preempted])
        self.num_batched_tokens += sum(s.num_new_tokens for s in scheduled)
        for child in out.forked:
            self._requests[child.request_id].seqs.append(child)
        if not scheduled:
            return None
        for s in scheduled:
            request = self._requests[s.seq.request_id]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
        # Several steps only if every row decodes: a fork's block copy or a prompt chunk makes it one.
        multi = not verified and not out.copies and any(s.num_steps > 1 for s in scheduled) and all(
            s.num_new_tokens == 1 and s.samples for s in scheduled)
        num_samples = [s.num_steps if multi else int(s.samples) for s in scheduled]  # before the counts move on
        drafts = [len(s.seq.draft_ids) for s in scheduled] if verified else None
        verify = dict(verify_inputs=self.speculator.verify_inputs(self.runner, scheduled)) if verified else {}
        sampled = self.runner.dispatch(scheduled, out.copies, num_samples if multi else None, **verify)
        engine_stats.track_peak(self, scheduled)
        for row, (s, n) in enumerate(zip(scheduled, num_samples)):
            # A step's token is computed for each sample after the first: the last stays pending.
            s.seq.num_computed_tokens += s.num_new_tokens + max(n - 1, 0)
            if n:
                s.seq.num_pending += n
                s.seq.sample_row = row
        return _InFlight(scheduled, num_samples, sampled, multi, drafts)

    def _read(self, flight: "_InFlight") -> list[RequestOutput]:
        """Take a dispatched step's samples into its sequences: append, stop, outputs."""
        sampled = self.runner.collect(flight.sampled)
        accepted = None
        if flight.drafts is not None:
            sampled, accepted = sampled
        elif not flight.multi_step:  # a leading axis of one step
            sampled = jax.tree.map(lambda x: x[None], sampled)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        next_row = 0  # a sequence with drafts has a row for each, then its own
        for i, (s, count) in enumerate(zip(flight.scheduled, flight.num_samples)):
            seq = s.seq
            num_drafts = flight.drafts[i] if flight.drafts is not None else 0
            row, next_row = next_row, next_row + 1 + num_drafts
            if not count:
                continue
            seq.num_pending -= count
            if seq.is_finished:  # aborted, or ended by its previous token: computed for nothing
                continue
            request = touched[seq.request_id] = self._requests[seq.request_id]
            if accepted is not None:
                n, reason = self.speculator.read(request, seq, sampled, accepted, row, num_drafts, now, self._stops)
                if reason is not None:
                    self._finish(seq, reason, now)
                self.speculator.settle(seq, num_drafts, n, self.blocks)
            elif request.params.use_beam_search:
                width = 2 * request.params.n
                seq.beam_candidates = list(zip(sampled.top_ids[0, row, :width].tolist(),
                                               sampled.top_logprobs[0, row, :width].tolist()))
                if seq.first_token_time is None:
                    seq.first_token_time = now
            elif (reason := output_processor.append_tokens(request, seq, sampled, row, count, now,
                                                           self._stops)) is not None:
                self._finish(seq, reason, now)
        outputs = []
        for request in touched.values():
            if request.params.use_beam_search and all(b.beam_candidates is not None for b in request.seqs):
                request.seqs = beam_search.advance(request.seqs, request.params, request.hypotheses, self.scheduler,
                                                   lambda: next(self._seq_ids), self.eos_token_ids,
                                                   self.resolved.max_model_len, now)
            output = output_processor.request_output(request, now)
            if request.finished:
                del self._requests[request.request_id]
            if output is not None:
                outputs.append(output)
        return outputs

    def _finish(self, seq: Sequence, reason: tuple, now: float) -> None:
        seq.finish_reason, seq.stop_reason = reason
        seq.finish_time = now
        self.scheduler.finish(seq)

    def stats(self) -> EngineStats:
        return engine_stats.snapshot(self)
