"""The live dashboard: `GET /dashboard`, a page the server serves whole (script and style inline, nothing
fetched from elsewhere), fed by `GET /dashboard/events`, server-sent events carrying one JSON state every
TICK_S seconds:

- the block pool, one entry per physical block (free, held, shared with its count of holders, cached,
  reserved) and the sequence holding it; the running, waiting and swapped sequences with their page
  tables; preemptions as the snapshots see them;
- the last minute's TTFT, ITL and end-to-end latency percentiles, throughput, KV usage, step time,
  compiles, rejections by cause, timeouts, goodput and the circuit breaker (from /metrics' registry).

The pool's picture is a snapshot (core/snapshot.py) taken on the engine loop's thread, between two
steps (AsyncLLMEngine.call), only while a page is open, at most every SNAPSHOT_INTERVAL_S and shared by
all open pages. What it cost the loop is in the state (`pool.snapshot_ms`, beside `step_ms`);
scripts/bench_snapshot.py measures it against the engine's step time.

With --api-key both routes want the key as the API does, or, since a browser's EventSource sends no
header, as `?key=KEY` in the page's URL; the page then sets it as a cookie (HttpOnly, SameSite=Strict,
path /dashboard) that its stream sends by itself. A stream ends after STREAM_S seconds and the browser
reconnects at once, so an open page never holds a graceful shutdown up for long.
"""

import asyncio
import collections
import hmac
import importlib.resources
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from prometheus_client import CollectorRegistry

from paged_jax.core.snapshot import STATE_NAMES, block_states, num_used_blocks, pool_snapshot
from paged_jax.serving.async_engine import AsyncLLMEngine, EngineDeadError, StatLogger
from paged_jax.serving.metrics import PREFIX
from paged_jax.serving.openai_errors import APIError
from paged_jax.serving.rolling import Rolling
from paged_jax.serving.stats import IterationStats, SchedulerStats

TICK_S = 0.25
SNAPSHOT_INTERVAL_S = 0.5
STREAM_S = 5.0
RETRY_MS = 200  # how soon the browser reconnects when a stream ends
THROUGHPUT_SPAN_S = 10.0
COOKIE = "paged_jax_key"
PATHS = frozenset({"/dashboard", "/dashboard/events"})

# Samples of the registry the state shows: name -> (key in the state, the label that splits it or None).
_COUNTERS = {
    PREFIX + "request_rejected_total": ("rejected", "cause"),
    PREFIX + "request_success_total": ("finished", "finished_reason"),
    PREFIX + "slo_violations_total": ("slo_violations", "objective"),
    PREFIX + "slo_goodput_total": ("slo_goodput", None),
    PREFIX + "circuit_breaker_open": ("breaker_open", None),
    PREFIX + "num_compiles_total": ("compiles", None),
    PREFIX + "num_preemptions_total": ("preemptions", None),
}


def _timed_snapshot(engine) -> dict:
    start = time.perf_counter()
    snap = pool_snapshot(engine)
    snap["cost_s"] = time.perf_counter() - start
    return snap


class DashboardFeed(StatLogger):
    """Rolling latencies (fed by the engine loop after every iteration) and pool snapshots (taken when
    a page asks), turned into the dashboard's states."""

    def __init__(self, registry: CollectorRegistry):
        """`engine` is set once the engine loop runs."""
        self.engine: AsyncLLMEngine | None = None
        self.registry = registry
        self.ttft, self.itl, self.e2e, self.step, self.tokens = Rolling(), Rolling(), Rolling(), Rolling(), Rolling()
        self._snapshot: dict | None = None
        self._asked = -float("inf")  # when the last snapshot was asked for
        self._pending: asyncio.Future | None = None
        self._preemptions: dict[int, int] = {}  # seq_id -> preemptions, as of the newest snapshot
        self.preemption_events: collections.deque[dict] = collections.deque(maxlen=20)

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        now = time.monotonic()
        self.ttft.add(now, iteration.time_to_first_tokens)
        self.itl.add(now, iteration.inter_token_latencies)
        self.e2e.add(now, [r.e2e_latency for r in iteration.finished if r.finish_reason in ("stop", "length")])
        if iteration.step_time is not None:
            self.step.add(now, (iteration.step_time,))
        if iteration.num_generation_tokens:
            self.tokens.add(now, (iteration.num_generation_tokens,))

    def latest(self) -> dict | None:
        """The newest snapshot (None before the first); asks the engine loop for the next one once
        SNAPSHOT_INTERVAL_S has passed since the last was asked for."""
        now = time.monotonic()
        idle = self._pending is None or self._pending.done()
        if idle and now - self._asked >= SNAPSHOT_INTERVAL_S and self.engine.is_running:
            self._asked = now
            self._pending = asyncio.ensure_future(self._take())
        return self._snapshot

    async def _take(self) -> None:
        try:
            snap = await self.engine.call(_timed_snapshot)
        except EngineDeadError:
            return
        self._note_preemptions(snap)
        self._snapshot = snap

    def _note_preemptions(self, snap: dict) -> None:
        seen = {}
        for s in snap["seqs"]:
            seen[s["seq_id"]] = s["num_preemptions"]
            if s["num_preemptions"] > self._preemptions.get(s["seq_id"], 0):
                self.preemption_events.appendleft({"time": time.time(), "seq_id": s["seq_id"],
                                                   "request_id": s["request_id"], "times": s["num_preemptions"]})
        self._preemptions = seen

    def state(self) -> dict:
        now = time.monotonic()
        snap = self.latest()
        stats = self.engine.scheduler_stats
        return {
            "time": time.time(),
            "engine_running": self.engine.is_running,
            "pool": None if snap is None else _pool(snap, now),
            "latency_ms": {name: w.percentiles(now, 1000.0) for name, w in
                           (("ttft", self.ttft), ("itl", self.itl), ("e2e", self.e2e))},
            "step_ms": self.step.percentiles(now, 1000.0),
            "output_tokens_per_s": round(self.tokens.rate(now, THROUGHPUT_SPAN_S), 1),
            "kv_usage": round(stats.kv_cache_usage, 4),
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "preemption_events": list(self.preemption_events),
        } | _counters(self.registry)

    async def events(self) -> AsyncIterator[str]:
        yield f"retry: {RETRY_MS}\n\n"
        end = time.monotonic() + STREAM_S
        while time.monotonic() < end:
            yield f"data: {json.dumps(self.state())}\n\n"
            await asyncio.sleep(TICK_S)


def _pool(snap: dict, now: float) -> dict:
    state, refs, owner = block_states(snap)
    return {
        "num_blocks": int(state.shape[0]), "block_size": snap["block_size"], "state_names": STATE_NAMES,
        "state": state.tolist(), "refs": refs.tolist(), "owner": owner.tolist(), "used": num_used_blocks(state),
        "age_ms": round(1000 * (now - snap["time"]), 1), "snapshot_ms": round(1000 * snap["cost_s"], 3),
        "seqs": [{"seq_id": s["seq_id"], "request_id": s["request_id"], "status": s["status"],
                  "priority": s["priority"], "adapter": s["lora_name"], "age_s": round(now - s["arrival_time"], 2),
                  "prompt_tokens": s["num_prompt_tokens"], "output_tokens": s["num_output_tokens"],
                  "computed_tokens": s["num_computed_tokens"], "preemptions": s["num_preemptions"],
                  "block_ids": s["block_ids"].tolist(), "swapped_blocks": s["num_swapped_blocks"]}
                 for s in snap["seqs"]],
    }


def _counters(registry: CollectorRegistry) -> dict:
    """The registry's samples the state shows, read in one pass."""
    out = {key: {} if label else 0.0 for key, label in _COUNTERS.values()}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in _COUNTERS:
                key, label = _COUNTERS[sample.name]
                if label is None:
                    out[key] = sample.value
                else:
                    out[key][sample.labels[label]] = sample.value
    return out


def _matches(offered: str | None, api_key: str) -> bool:
    return offered is not None and hmac.compare_digest(offered.encode(), api_key.encode())


def _authorized(request: Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    offered = (token.strip() if scheme.lower() == "bearer" else None, request.query_params.get("key"),
               request.cookies.get(COOKIE))
    return any(_matches(k, api_key) for k in offered)


def dashboard_router(feed: DashboardFeed, api_key: str | None, on_reject) -> APIRouter:
    """The page and its stream (out of the API's schema: neither is for programs)."""
    router = APIRouter(include_in_schema=False)
    page = (importlib.resources.files("paged_jax.serving") / "static" / "dashboard.html").read_text()

    def check(request: Request) -> None:
        if api_key and not _authorized(request, api_key):
            on_reject()
            raise APIError(401, "missing or incorrect API key: open /dashboard?key=KEY (or send 'Authorization: "
                           "Bearer KEY')", code="invalid_api_key")

    @router.get("/dashboard")
    async def dashboard(request: Request):
        check(request)
        response = HTMLResponse(page, headers={"Cache-Control": "no-store"})
        if api_key and _matches(request.query_params.get("key"), api_key):
            response.set_cookie(COOKIE, request.query_params["key"], httponly=True, samesite="strict",
                                path="/dashboard")
        return response

    @router.get("/dashboard/events")
    async def events(request: Request):
        check(request)
        return StreamingResponse(feed.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return router
