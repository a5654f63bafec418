"""Latency objectives (SLOs) at the server's door: goodput counted, and requests that could only miss
their time to first token refused before they queue.

- Objectives: `--slo-ttft-ms` (time to first token) and `--slo-tpot-ms` (time per output token after
  the first); a request may ask for tighter ones (`slo_ttft_ms`, `slo_tpot_ms` in its body), never
  looser. A request without any objective meets them all.
- Goodput: requests that finished (stop or length) within every objective they had, the count that
  `vllm bench serve --goodput` reports, in `paged_jax:slo_goodput_total`; misses in
  `paged_jax:slo_violations_total{objective}`. TTFT runs from the request's admission here.
- Admission: a new request's time to first token is predicted two ways, and the longer counts:
  - by the work ahead of it, in tokens: the prompt tokens of the requests admitted that have no first
    token yet, and its own, at the cost of a prompt token (prefill_clock.py: measured by a probe step
    right after the warm-up, so it holds for a replica that has served nothing, then refined from
    the steps the engine runs). This is what sheds a burst on a cold replica.
  - by the line for sequence slots: (its place in the line) / (service rate), the service rate being
    requests served (finished with stop or length) per second while the engine was full (every
    sequence slot taken, or requests waiting: then finishes are what lets the line move), decayed
    over about half a minute; none before the first such measurement. Slots kept full count even when
    admission keeps the queue empty, so that a rate measured low (in steps that compiled, say) is
    measured again. The place in the line counts requests beyond max_num_seqs; where the pool, not
    max_num_seqs, holds the queue back, the prediction is short by those.
  When the prediction exceeds the request's TTFT objective, and something ahead of it is the cause
  (a prompt that alone takes longer is admitted: waiting would not help it), it gets 429 with
  `Retry-After` = prediction - objective, rounded up: by then the work ahead is short enough.
- A queue timeout (`--max-queue-time`, enforced by the engine loop) ends the request with 503.
"""

import dataclasses
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from paged_jax.core.outputs import RequestOutput
from paged_jax.serving.async_engine import AsyncLLMEngine, RequestStream, StatLogger
from paged_jax.serving.metrics import PREFIX
from paged_jax.serving.openai_protocol import SamplingRequest
from paged_jax.serving.openai_errors import APIError, bad_request
from paged_jax.serving.prefill_clock import PrefillClock
from paged_jax.serving.stats import IterationStats, SchedulerStats

_RATE_TIME_CONSTANT_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class Objective:
    """Milliseconds, as the flags give them (in seconds, the tiniest would round to 0)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self):
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"the {name} objective must be positive, got {value}")

    def missed(self, ttft: float, tpot: float | None) -> list[str]:
        """The objectives missed by a request with that TTFT and TPOT in seconds (None: one output token)."""
        return [name for name, limit, value in (("ttft", self.ttft_ms, ttft), ("tpot", self.tpot_ms, tpot))
                if limit is not None and value is not None and 1000 * value > limit]


class ServiceRate:
    """Requests finished per second of time the engine spent full, old time weighing less (a time
    constant of tau seconds). Fed by the engine loop's thread; `per_second` read anywhere."""

    def __init__(self, tau: float = _RATE_TIME_CONSTANT_S):
        self.tau = tau
        self.per_second: float | None = None  # None until a request finished while the engine was full
        self._busy = 0.0
        self._done = 0.0
        self._last: float | None = None
        self._full = False

    def observe(self, now: float, num_finished: int, full: bool) -> None:
        """num_finished requests ended since the last call; `full`: whether the engine is full now."""
        if self._last is not None and self._full:
            elapsed = now - self._last
            decay = math.exp(-elapsed / self.tau)
            self._busy = self._busy * decay + elapsed
            self._done = self._done * decay + num_finished
            if self._done > 0 and self._busy > 0:
                self.per_second = self._done / self._busy
        self._last, self._full = now, full


class SloGuard(StatLogger):
    def __init__(self, objective: Objective, registry: CollectorRegistry, model_name: str):
        """objective: the server's; requests may tighten it. `engine` is set once the engine loop runs."""
        self.engine: AsyncLLMEngine | None = None
        self.objective = objective
        self.rate = ServiceRate()
        self.clock = PrefillClock()
        self.pending_tokens = 0  # prompt tokens of admitted requests without a first token (server thread)
        labels = {"model_name": model_name}
        self._goodput = Counter(PREFIX + "slo_goodput", "Requests that finished (stop or length) within every "
                                "latency objective they had (vllm bench serve --goodput's count).", ["model_name"],
                                registry=registry).labels(**labels)
        violations = Counter(PREFIX + "slo_violations", "Finished requests that missed an objective, by objective "
                             "(one that missed both counts under each).", ["model_name", "objective"],
                             registry=registry)
        self._violations = {name: violations.labels(**labels, objective=name) for name in ("ttft", "tpot")}
        Gauge(PREFIX + "slo_service_rate", "Requests served per second while the engine was full: what admission "
              "by SLO predicts queue waits from (0 before it is measured).", ["model_name"],
              registry=registry).labels(**labels).set_function(lambda: self.rate.per_second or 0.0)

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        full = scheduler.num_waiting > 0 or scheduler.num_running >= self.engine.limits.max_num_seqs
        served = sum(r.finish_reason in ("stop", "length") for r in iteration.finished)
        self.rate.observe(time.monotonic(), served, full)
        if iteration.step_time is not None:
            self.clock.observe(iteration.step_time, iteration.num_batched_tokens)

    def objective_for(self, request: SamplingRequest) -> Objective:
        """The server's objectives, tightened by the request's own; a looser one is a 400."""
        return Objective(_within(request.slo_ttft_ms, self.objective.ttft_ms, "slo_ttft_ms", "--slo-ttft-ms"),
                         _within(request.slo_tpot_ms, self.objective.tpot_ms, "slo_tpot_ms", "--slo-tpot-ms"))

    def admit(self, request: SamplingRequest, prompt_tokens: list[int]) -> "Admission":
        """Let in the engine requests of an API request (prompt_tokens: each one's prompt length), or
        refuse them (429) when they would miss their TTFT objective for the work ahead of them; a
        looser objective than the server's is a 400."""
        objective = self.objective_for(request)
        if objective.ttft_ms is not None:
            self._check_ttft(objective, prompt_tokens)
        # Its prompts are work ahead of later requests from now (handlers interleave at each await).
        self.pending_tokens += sum(prompt_tokens)
        return Admission(self, objective, time.monotonic(), list(prompt_tokens))

    def _check_ttft(self, objective: Objective, prompt_tokens: list[int]) -> None:
        """Raise 429 when the predicted time to first token exceeds the objective because of what is ahead."""
        own, ahead, why = sum(prompt_tokens), self.pending_tokens, []
        cost = self.clock.seconds_per_token
        wait = (ahead + own) * cost if cost and ahead else 0.0
        if wait:
            why.append(f"{ahead} prompt tokens ahead and {own} of its own at {1000 * cost:.3f} ms a token")
        place, rate = self.engine.queue_position(len(prompt_tokens)), self.rate.per_second
        if rate and place and place / rate > wait:
            wait = place / rate
            why = [f"{place} requests to finish at {rate:.2f} a second"]
        if 1000 * wait <= objective.ttft_ms:
            return
        raise APIError(429, f"the predicted time to first token, {wait:.2f} s ({why[0]}), exceeds this request's "
                       f"objective of {objective.ttft_ms:g} ms; retry later", type="rate_limit_error",
                       code="slo_unattainable", cause="slo_admission",
                       headers={"Retry-After": str(max(1, math.ceil(wait - objective.ttft_ms / 1000)))})

    def score(self, out: RequestOutput, admission: "Admission") -> None:
        """Count a finished request as goodput or as the objectives it missed."""
        if any(c.finish_reason not in ("stop", "length") for c in out.outputs):
            return
        m = out.metrics
        ttft = m.first_token_time - admission.time
        tpot = (m.finish_time - m.first_token_time) / (m.num_output_tokens - 1) if m.num_output_tokens > 1 else None
        missed = admission.objective.missed(ttft, tpot)
        for name in missed:
            self._violations[name].inc()
        if not missed:
            self._goodput.inc()


@dataclasses.dataclass(frozen=True)
class Admission:
    """An API request let in: its objectives, and when (its TTFT runs from then)."""

    guard: SloGuard
    objective: Objective
    time: float  # time.monotonic()
    unwatched: list[int]  # prompt lengths of its engine requests not yet watched, counted as work ahead

    def watch(self, stream: RequestStream, prompt_tokens: int) -> "GuardedStream":
        """stream: the engine request of a prompt of prompt_tokens tokens; it gives them back once started."""
        self.unwatched.remove(prompt_tokens)
        return GuardedStream(stream, self, prompt_tokens)

    def release(self) -> None:
        """The prompts never added to the engine (one was refused) are no longer work ahead."""
        self.guard.pending_tokens -= sum(self.unwatched)
        self.unwatched.clear()


class GuardedStream:
    """A RequestStream (iterate it, close it) that is scored when it finishes, whose end by the queue
    timeout raises a 503, and whose prompt counts as work ahead of later requests until its first output."""

    def __init__(self, stream: RequestStream, admission: Admission, prompt_tokens: int):
        self.request_id = stream.request_id
        self._stream, self._admission = stream, admission
        self._pending = prompt_tokens

    def _started(self) -> None:
        """Its prompt is done (a first output) or will never be (closed): no longer work ahead."""
        self._admission.guard.pending_tokens -= self._pending
        self._pending = 0

    def __aiter__(self) -> "GuardedStream":
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self._stream.__anext__()
        self._started()
        if out.finished:
            if any(c.finish_reason == "queue_timeout" for c in out.outputs):
                waited = out.metrics.finish_time - out.metrics.arrival_time
                raise APIError(503, f"the request waited {waited:.1f} s for the engine to admit it, longer than "
                               f"this server's --max-queue-time; retry later", type="server_error",
                               code="queue_timeout")
            self._admission.guard.score(out, self._admission)
        return out

    def close(self) -> None:
        self._started()
        self._stream.close()


def _within(asked_ms: float | None, server_ms: float | None, param: str, flag: str) -> float | None:
    if asked_ms is None:
        return server_ms
    if server_ms is not None and asked_ms > server_ms:
        raise bad_request(f"{param}={asked_ms:g} is looser than this server's {flag} of {server_ms:g} ms", param)
    return asked_ms
