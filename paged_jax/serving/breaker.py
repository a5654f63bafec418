"""A circuit breaker over the engine loop: when its steps keep failing, or the loop has died, tell the
load balancer and refuse new work at once, rather than accept requests that can only fail.

    closed --(threshold consecutive failed steps, or the engine loop dead)--> open
    open --(a healthy step: a probe's, or that of a request still running)--> closed

While it is open, `GET /ready` answers 503 (after a probe: a one-token request sent straight to the
engine, whose success closes the breaker), and completions get 503 with code "circuit_open" before
their body is read; each refusal starts a probe too, one every probe_interval seconds at most, so
traffic alone closes it again. /metrics shows `paged_jax:circuit_breaker_open` (1 or 0) and
`paged_jax:circuit_breaker_trips_total`. A probe is a request like any other in the metrics.
"""

import asyncio
import logging
import math
import threading
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge

from paged_jax.core.sampling_params import SamplingParams
from paged_jax.serving.async_engine import AsyncLLMEngine, StatLogger
from paged_jax.serving.metrics import PREFIX
from paged_jax.serving.openai_errors import APIError
from paged_jax.serving.stats import IterationStats, SchedulerStats

log = logging.getLogger(__name__)

GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class CircuitBreaker(StatLogger):
    def __init__(self, registry: CollectorRegistry, model_name: str, *, threshold: int = 3,
                 probe_interval: float = 5.0, probe_timeout: float = 60.0):
        """threshold: consecutive failed steps that open it. probe_timeout: seconds a probe may take
        (its first step may compile). `engine` is set once the engine loop runs."""
        if threshold < 1:
            raise ValueError(f"the breaker's threshold must be at least 1, got {threshold}")
        self.engine: AsyncLLMEngine | None = None
        self.threshold, self.probe_interval, self.probe_timeout = threshold, probe_interval, probe_timeout
        self._lock = threading.Lock()  # the loop's thread and the server's both change the state
        self._failures = 0
        self._reason: str | None = None
        self._probe: asyncio.Future | None = None
        self._last_probe = -float("inf")
        labels = {"model_name": model_name}
        Gauge(PREFIX + "circuit_breaker_open", "1 while the circuit breaker refuses requests (failing steps or a "
              "dead engine loop), else 0.", ["model_name"], registry=registry).labels(**labels).set_function(
            lambda: float(self.open_reason is not None))
        self._trips = Counter(PREFIX + "circuit_breaker_trips", "Times the circuit breaker opened after failed steps.",
                              ["model_name"], registry=registry).labels(**labels)

    @property
    def open_reason(self) -> str | None:
        """Why the breaker is open; None while it is closed."""
        if self.engine is None or not self.engine.is_running:
            return "the engine loop is not running"
        return self._reason

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        # A failed step ends its requests with "error"; a step that ran tokens without that is healthy.
        failed = any(r.finish_reason == "error" for r in iteration.finished)
        if failed:
            with self._lock:
                self._failures += 1
                if self._failures >= self.threshold and self._reason is None:
                    self._reason = f"{self._failures} consecutive engine steps failed"
                    self._trips.inc()
                    log.error("circuit breaker open: %s", self._reason)
        elif iteration.step_time is not None and iteration.num_batched_tokens > 0:
            self._close()

    def _close(self) -> None:
        with self._lock:
            if self._reason is not None:
                log.warning("circuit breaker closed: a step succeeded")
            self._failures, self._reason = 0, None

    async def probe(self) -> None:
        """Run a probe (or join the one running); a success closes the breaker."""
        await asyncio.shield(self._start_probe())

    def probe_soon(self) -> None:
        """Start a probe in the background unless one started less than probe_interval seconds ago."""
        if time.monotonic() - self._last_probe >= self.probe_interval:
            self._start_probe()

    def _start_probe(self) -> asyncio.Future:
        if self._probe is None or self._probe.done():
            self._last_probe = time.monotonic()
            self._probe = asyncio.ensure_future(self._run_probe())
        return self._probe

    async def _run_probe(self) -> None:
        try:
            async with asyncio.timeout(self.probe_timeout):
                async for out in self.engine.generate([0], SamplingParams(max_tokens=1, temperature=0.0)):
                    pass
        except Exception as e:
            log.warning("circuit breaker probe failed: %s: %s", type(e).__name__, e)
            return
        if out.error is None:
            self._close()


def readiness_router(breaker: CircuitBreaker) -> APIRouter:
    router = APIRouter()

    @router.get("/ready", responses={200: {"description": "taking requests"}, 503: {"description": "refusing them"}})
    async def ready():
        if breaker.open_reason is not None:
            await breaker.probe()
        reason = breaker.open_reason
        if reason is not None:
            raise APIError(503, f"not ready: {reason}", type="server_error", code="circuit_open")
        return {"status": "ready"}

    return router


class FailFast:
    """ASGI middleware: while the breaker is open, completions get 503 before their body is read."""

    def __init__(self, app, breaker: CircuitBreaker, on_reject):
        self.app, self.breaker, self.on_reject = app, breaker, on_reject

    async def __call__(self, scope, receive, send):
        reason = self.breaker.open_reason if scope["type"] == "http" and scope["path"] in GUARDED_PATHS else None
        if reason is None:
            return await self.app(scope, receive, send)
        self.on_reject()
        self.breaker.probe_soon()
        error = APIError(503, f"this server is refusing requests: {reason}; retry elsewhere or later",
                         type="server_error", code="circuit_open")
        retry_after = str(max(1, math.ceil(self.breaker.probe_interval)))
        await JSONResponse(error.body(), status_code=503, headers={"Retry-After": retry_after})(scope, receive, send)
