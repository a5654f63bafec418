"""LLMEngine: requests in, incremental outputs out, one scheduling decision and one model call a step.

A server drives it from a background loop (add_request / abort_request from request handlers, step in
the loop); LLM (llm.py) drives it to completion for offline batches.
"""

import dataclasses
import itertools
import logging
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import models
from models.loader import cache_dir, shard_model
from models.sharding import make_mesh
from paged_jax.core import beam_search, distributed
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.config import EngineConfig, default_device, default_dtype, resolve
from paged_jax.core.model_runner import ModelRunner
from paged_jax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.core.policy import check_priority
from paged_jax.core.sampling_params import MAX_LOGPROBS, SamplingParams
from paged_jax.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from paged_jax.core.sequence import Sequence

logger = logging.getLogger(__name__)

_MAX_SEED = 2**31 - 1


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # live beams, for beam search
    arrival_time: float
    hypotheses: list[beam_search.Hypothesis] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_preemptions: int
    num_compiles: int
    peak_blocks_in_use: int
    prefix_cache_hit_blocks: int
    prefix_cache_queried_blocks: int
    attention_backend: str
    attention_backend_reason: str
    matmul_backend: str
    matmul_backend_reason: str
    num_batched_tokens: int  # tokens run through the model so far (prompt chunks and decodes)


def _enable_compilation_cache() -> None:
    """Keep compiled programs on disk, so a second run starts without compiling (unless the user
    chose a cache of their own). Every program: JAX keeps only those that took a second or more to
    compile by default, but the block pool's small ones add up to about half a second a start, and
    loading one takes milliseconds."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _mesh(config: EngineConfig) -> Mesh | None:
    """The mesh the engine splits the model over, or None on one device. In a group of processes
    (distributed.py) it spans every process's devices."""
    distributed.check_mesh_size(config.tensor_parallel_size)
    return make_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None


class LLMEngine:
    def __init__(self, model, model_config, tokenizer, config: EngineConfig | None = None):
        """model: a models.LlamaForCausalLM on the default device (where the engine runs), or already
        split over the engine's mesh (models.load_model(..., mesh=...)); tokenizer: a transformers tokenizer.

        With tensor_parallel_size N > 1 the engine runs on the first N devices, the model split over
        them (models/sharding.py); model_config is then the split model's (KV heads' copies counted).
        """
        _enable_compilation_cache()
        self.config = config or EngineConfig()
        mesh = _mesh(self.config)
        if mesh is not None:
            model = shard_model(model, mesh)
            model_config = dataclasses.replace(model_config, num_kv_heads=model.config.num_kv_heads)
        self.model_config = model_config
        self.tokenizer = tokenizer
        weights_dtype = jnp.result_type(*jax.tree.leaves(nnx.state(model, nnx.Param)))
        self.resolved = resolve(self.config, model_config, default_device(), weights_dtype)
        # In a group of processes each holds a share of one cache: the fewest blocks any has room for.
        num_blocks = distributed.agree(self.resolved.num_blocks, (self.config, model_config))
        if num_blocks != self.resolved.num_blocks:
            self.resolved = resolve(dataclasses.replace(self.config, num_blocks=num_blocks), model_config,
                                    default_device(), weights_dtype)
        attention = self.resolved.attention
        # A fallback is slower by a wide margin: said where a user sees it, not only in the stats.
        logger.log(logging.WARNING if attention.fallback else logging.INFO, "attention backend %s: %s",
                   attention.backend, attention.reason)
        logger.info("matmul backend %s: %s", self.resolved.matmul_backend, self.resolved.matmul.reason)
        if self.resolved.matmul_backend == "cpu":
            model = models.pack_for_cpu(model, self.config.quantization)
        self.runner = ModelRunner(model, model_config, self.resolved, mesh)
        self.blocks = BlockManager(self.resolved.num_blocks, self.resolved.block_size,
                                   self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks, swapper=self.runner)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._seeds = itertools.count(self.config.seed * 1_000_003)
        self.peak_blocks_in_use = 0
        self.peak_slot_fill = 0.0
        self.num_batched_tokens = 0

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m", config: EngineConfig | None = None,
                        **options) -> "LLMEngine":
        """Load `model` and build an engine from `config` or, without one, from EngineConfig's fields as keywords."""
        if config is not None and options:
            raise TypeError("give either an EngineConfig or its fields as keywords, not both")
        config = config or EngineConfig(**options)
        dtype = default_dtype(default_device().platform) if config.dtype == "auto" else config.dtype
        loaded = models.load_model(model, dtype=jnp.dtype(dtype), mesh=_mesh(config))
        return cls(loaded.model, loaded.config, loaded.tokenizer, config)

    # Requests.

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue a prompt (text or token ids). Everything is checked here, never inside a step.

        priority: under scheduling_policy "priority", lower runs first; any other policy refuses a
        priority other than 0 (as vLLM does), rather than silently ignoring it."""
        params = params or SamplingParams()
        check_priority(self.config.scheduling_policy, priority)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.use_beam_search:
            if 2 * params.n > MAX_LOGPROBS:
                raise ValueError(f"beam width n={params.n} is above {MAX_LOGPROBS // 2}: each beam proposes 2n tokens "
                                 f"from the sampler's top {MAX_LOGPROBS} logprobs")
            if params.stop:
                raise ValueError("stop strings are not supported with beam search; use stop_token_ids")
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise ValueError("this model has no tokenizer: give prompts as token ids and no stop strings")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        limit = self.resolved.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens is too long: max_model_len is {limit} "
                f"(the prompt and at least one generated token must fit)"
            )
        seed = params.seed if params.seed is not None else next(self._seeds) % _MAX_SEED
        seq_id = next(self._seq_ids)
        # A request with n samples reserves n consecutive sequence ids for its forks.
        for _ in range(params.n - 1):
            next(self._seq_ids)
        # Beams ask the sampler for their 2n best proposals; n samples fork once the prompt is computed.
        seq_params = dataclasses.replace(params, logprobs=2 * params.n) if params.use_beam_search else params
        now = time.monotonic()
        seq = Sequence(seq_id=seq_id, request_id=request_id, token_ids=list(token_ids),
                       num_prompt_tokens=len(token_ids), params=seq_params, seed=seed,
                       arrival_time=now, priority=priority, forks=1 if params.use_beam_search else params.n)
        self._requests[request_id] = _Request(request_id, text, list(token_ids), params, [seq], now)
        self.scheduler.add(seq)
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

    # The step.

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs for the requests that advanced.

        If anything in a step fails (a bug, an input no check caught), step() does not raise: the
        error is logged, and the requests in the step end at once with their blocks freed, each with a
        finished output whose completions have finish_reason "error" and RequestOutput.error set.
        The requests in the step are those it scheduled or, when scheduling itself failed, all that
        were running. The others go on, computed again if the failure took the KV cache with it.
        """
        requests = dict(self._requests)  # as they stood before the step, in case it fails
        out = None
        try:
            out = self.scheduler.schedule()
            return self._run(out)
        except Exception as error:
            logger.exception("an engine step failed; its requests end with an error")
            seqs = self.scheduler.running if out is None else [*(s.seq for s in out.scheduled), *out.forked]
            return self._fail(list(dict.fromkeys(s.request_id for s in seqs)), requests, error)

    def _fail(self, request_ids: list[str], requests: dict[str, _Request], error: Exception) -> list[RequestOutput]:
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
            # No text: decoding may be what failed.
            completions = [CompletionOutput(s.index, "", list(s.output_token_ids),
                                            s.cumulative_logprob if s.params.logprobs is not None else None, None, "error")
                           for s in request.seqs]
            metrics = self._metrics(request, now, max((len(c.token_ids) for c in completions), default=0))
            outputs.append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                                         True, metrics, error=f"{type(error).__name__}: {error}"))
        if self.runner.restore_kv_cache():
            # The failure took every block's content with it: nothing computed may be read again.
            self.scheduler.recompute_all()
            self.blocks.reset_prefix_cache()
        return outputs

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        self.num_batched_tokens += out.num_tokens
        for child in out.forked:
            self._requests[child.request_id].seqs.append(child)
        if not out.scheduled:
            return []
        scheduled = out.scheduled
        sampled = self.runner.execute(scheduled, out.copies)
        self._track_peak(scheduled)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for row, s in enumerate(scheduled):
            seq, samples = s.seq, s.samples
            seq.num_computed_tokens += s.num_new_tokens
            if not samples:
                continue
            request = touched[seq.request_id] = self._requests[seq.request_id]
            if request.params.use_beam_search:
                width = 2 * request.params.n
                seq.beam_candidates = list(zip(sampled.top_ids[row, :width].tolist(), sampled.top_logprobs[row, :width].tolist()))
                if seq.first_token_time is None:
                    seq.first_token_time = now
            else:
                self._append_token(seq, sampled, row, now)
        for request in touched.values():
            if request.params.use_beam_search and all(b.beam_candidates is not None for b in request.seqs):
                self._advance_beams(request, now)
        return [self._output(r) for r in touched.values()]

    def _advance_beams(self, request: _Request, now: float) -> None:
        params = request.params
        beams = request.seqs
        ending = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        banned = ending if beams[0].num_output_tokens < params.min_tokens else set()
        selection = beam_search.select(beams, params.n, frozenset(ending), frozenset(banned))
        request.hypotheses += selection.finished
        # Forks first, while every parent still holds the tokens its children continue from.
        continuing, live = set(), []
        for parent, token, total in selection.survivors:
            if parent.seq_id in continuing:
                child = self.scheduler.fork(parent, seq_id=next(self._seq_ids), index=len(live))
            else:
                continuing.add(parent.seq_id)
                child = parent
            live.append((child, token, total))
        for beam in beams:
            if beam.seq_id not in continuing:
                self.scheduler.finish(beam)
        request.seqs = []
        for index, (beam, token, total) in enumerate(live):
            beam.token_ids.append(token)
            beam.cumulative_logprob, beam.index, beam.beam_candidates = total, index, None
            request.seqs.append(beam)
        lead = request.seqs[0] if request.seqs else None
        at_length = lead is None or lead.num_output_tokens >= params.max_tokens or lead.num_tokens >= self.resolved.max_model_len
        if at_length or len(request.hypotheses) >= params.n:
            for beam in request.seqs:
                if at_length:
                    request.hypotheses.append(beam_search.Hypothesis(
                        tuple(beam.output_token_ids), beam.cumulative_logprob, "length"))
                beam.finish_time = now
                self.scheduler.finish(beam)

    def _track_peak(self, scheduled: list[ScheduledSeq]) -> None:
        """Peak blocks held by sequences, and the share of their slots holding real tokens."""
        in_use = self.blocks.num_blocks - 1 - self.blocks.num_free - self.blocks.num_evictable
        if in_use > self.peak_blocks_in_use:
            self.peak_blocks_in_use = in_use
            held = sum(s.num_new_tokens for s in scheduled) + sum(s.num_computed_tokens for s in self.scheduler.running)
            self.peak_slot_fill = held / (in_use * self.resolved.block_size)

    def _append_token(self, seq: Sequence, sampled, row: int, now: float) -> None:
        token = int(sampled.tokens[row])
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.params.logprobs is not None:
            entry = {token: float(sampled.logprobs[row])}
            for tid, lp in zip(sampled.top_ids[row, : seq.params.logprobs], sampled.top_logprobs[row, : seq.params.logprobs]):
                entry.setdefault(int(tid), float(lp))
            seq.logprobs.append(entry)
            # Only then does the sampler compute logprobs (sampling.py); vLLM's rule too.
            seq.cumulative_logprob += float(sampled.logprobs[row])
        reason = self._stop_reason(seq, token)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            seq.finish_time = now
            self.scheduler.finish(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            stop = self._find_stop(seq) if params.stop else None
            if stop is not None:
                return "stop", stop
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.resolved.max_model_len:
            return "length", None
        return None

    def _find_stop(self, seq: Sequence) -> str | None:
        """The stop string that occurs first in the output text, or None."""
        text = self._decode(seq.output_token_ids)
        hits = [(text.find(s), s) for s in seq.params.stop if s in text]
        return min(hits)[1] if hits else None

    def _decode(self, token_ids: list[int]) -> str:
        # A model loaded without tokenizer files speaks token ids only.
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _output(self, request: _Request) -> RequestOutput:
        if request.params.use_beam_search:
            return self._beam_output(request)
        completions = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            text = self._decode(seq.output_token_ids)
            if isinstance(seq.stop_reason, str):
                text = text[: text.find(seq.stop_reason)]
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = len(completions) == request.params.n and all(c.finished for c in completions)
        if finished:
            del self._requests[request.request_id]
        last = [s.finish_time for s in request.seqs if s.finish_time is not None]
        metrics = self._metrics(request, max(last) if finished and last else None,
                                max(s.num_output_tokens for s in request.seqs))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, metrics)

    def _beam_output(self, request: _Request) -> RequestOutput:
        """The live beams while the search runs; the best n hypotheses once it is over."""
        finished = all(b.is_finished for b in request.seqs)
        if finished:
            ranked = beam_search.best(request.hypotheses, request.params.n, request.params.length_penalty)
            completions = [CompletionOutput(i, self._decode(list(h.token_ids)), list(h.token_ids), h.cumulative_logprob,
                                            None, h.finish_reason, h.stop_reason) for i, h in enumerate(ranked)]
            del self._requests[request.request_id]
        else:
            completions = [CompletionOutput(b.index, self._decode(b.output_token_ids), list(b.output_token_ids),
                                            b.cumulative_logprob, None, None) for b in request.seqs]
        metrics = self._metrics(request, time.monotonic() if finished else None,
                                max((len(c.token_ids) for c in completions), default=0))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished, metrics)

    @staticmethod
    def _metrics(request: _Request, finish_time: float | None, num_output_tokens: int) -> RequestMetrics:
        first = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_token_time=min(first) if first else None,
            finish_time=finish_time,
            num_output_tokens=num_output_tokens,
            num_prefix_hit_tokens=request.seqs[0].num_prefix_hit_tokens if request.seqs else 0,
            num_preemptions=sum(s.num_preemptions for s in request.seqs))

    # Introspection.

    def stats(self) -> EngineStats:
        cache = self.blocks.cache
        return EngineStats(
            num_preemptions=self.scheduler.num_preemptions,
            num_compiles=self.runner.num_compiles,
            peak_blocks_in_use=self.peak_blocks_in_use,
            prefix_cache_hit_blocks=cache.hit_blocks if cache else 0,
            prefix_cache_queried_blocks=cache.queried_blocks if cache else 0,
            attention_backend=self.resolved.attention.backend,
            attention_backend_reason=self.resolved.attention.reason,
            matmul_backend=self.resolved.matmul.backend,
            matmul_backend_reason=self.resolved.matmul.reason,
            num_batched_tokens=self.num_batched_tokens)
