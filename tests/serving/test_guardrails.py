"""SLO guardrails on a tiny model whose steps are slowed to a known pace, one sequence at a time, so that
outcomes are certain by construction: admission by SLO (a burst beyond the TTFT objective gets 429 with
Retry-After, the admitted requests meet it), goodput and violations, the queue timeout (503, nothing
left held), and the circuit breaker (failing steps open it, a healthy probe closes it)."""

import asyncio
import json
import time

import httpx
import pytest

from conftest import fail_on_host, running_server, slow_steps
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, parse_events, wait_for_idle

STEP_DELAY_S = 0.1
MAX_TOKENS = 8
BODY = dict(model="tiny", prompt=[11] * 12, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
# The burst's TTFT objective in units of the measured service time W: the k-th request in line is predicted to
# wait k W, so k = 0, 1, 2 are admitted and the rest refused; the last admitted waits about 2 W (and a step).
OBJECTIVE_IN_SERVICE_TIMES = 2.9
BURST = 8


def make_engine(tiny_chat_model, **options) -> LLMEngine:
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(block_size=16, num_blocks=64, max_num_seqs=1, **options))
    slow_steps(engine, STEP_DELAY_S)
    return engine


def serve(tiny_chat_model, **config):
    app = build_app(make_engine(tiny_chat_model), ServerConfig(served_model_name="tiny", **config))
    return app, running_server(app)


async def first_token(http: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float | None, str]:
    """Stream a completion: (the response, seconds to its first chunk or None unless it was 200, its body)."""
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        ttft, lines = None, []
        async for line in r.aiter_lines():
            if ttft is None and r.status_code == 200 and line.startswith("data: {"):
                ttft = time.perf_counter() - start
            lines.append(line)
        return r, ttft, "\n".join(lines)


async def burst(base: str, bodies: list[dict]) -> list[tuple[httpx.Response, float | None, str]]:
    async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
        return await asyncio.gather(*(first_token(http, b) for b in bodies))


@pytest.fixture(scope="module")
def slo_server(tiny_chat_model):
    # A generous server-wide objective; the tests' requests tighten it.
    _, server = serve(tiny_chat_model, slo_ttft_ms=60_000)
    with server as url:
        yield url


def test_requests_may_tighten_the_objectives_but_not_loosen_them(slo_server):
    r = httpx.post(f"{slo_server}/v1/completions", json=BODY | {"slo_ttft_ms": 70_000}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "slo_ttft_ms"
    r = httpx.post(f"{slo_server}/v1/completions", json=BODY | {"slo_ttft_ms": 50_000}, timeout=TIMEOUT)
    assert r.status_code == 200


def test_a_burst_beyond_the_ttft_objective_is_refused_and_the_admitted_meet_it(slo_server):
    url = slo_server
    # Warm up (compiles), then pairs: the engine full, the second of each waiting while the first
    # finishes, which measures the service rate.
    asyncio.run(burst(url, [BODY]))
    for _ in range(2):
        assert all(r.status_code == 200 for r, _, _ in asyncio.run(burst(url, [BODY, BODY])))
    before = wait_for_idle(url)
    rate = before['paged_jax:slo_service_rate']
    assert rate > 0
    objective_ms = 1000 * OBJECTIVE_IN_SERVICE_TIMES / rate

    results = asyncio.run(burst(url, [BODY | {"slo_ttft_ms": objective_ms}] * BURST))
    admitted = [ttft for r, ttft, _ in results if r.status_code == 200]
    refused = [(r, body) for r, _, body in results if r.status_code == 429]
    assert len(admitted) == 3 and len(refused) == BURST - 3, [r.status_code for r, _, _ in results]
    assert all(ttft < objective_ms / 1000 for ttft in admitted), (admitted, objective_ms)
    for r, body in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["code"] == "slo_unattainable"
    after = wait_for_idle(url)
    assert after['paged_jax:request_rejected_total{cause="slo_admission"}'] == BURST - 3
    assert after["paged_jax:slo_goodput_total"] - before["paged_jax:slo_goodput_total"] == 3
    assert after['paged_jax:slo_violations_total{objective="ttft"}'] == 0


def test_a_missed_tpot_objective_is_a_violation_not_goodput(slo_server):
    before = wait_for_idle(slo_server)
    r = httpx.post(f"{slo_server}/v1/completions", json=BODY | {"slo_tpot_ms": 1}, timeout=TIMEOUT)
    assert r.status_code == 200
    after = wait_for_idle(slo_server)
    assert after['paged_jax:slo_violations_total{objective="tpot"}'] - before[
        'paged_jax:slo_violations_total{objective="tpot"}'] == 1
    assert after["paged_jax:slo_goodput_total"] == before["paged_jax:slo_goodput_total"]


def test_a_request_waiting_past_the_max_queue_time_gets_503_and_holds_nothing(tiny_chat_model):
    _, server = serve(tiny_chat_model, max_queue_time=0.5)
    with server as url:
        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                assert (await http.post("/v1/completions", json=BODY)).status_code == 200  # compiles
                long = asyncio.ensure_future(http.post("/v1/completions", json=BODY | {"max_tokens": 60}))
                while metrics(url)["paged_jax:num_requests_running"] < 1:
                    await asyncio.sleep(0.02)
                waited, streamed = await asyncio.gather(http.post("/v1/completions", json=BODY),
                                                        http.post("/v1/completions", json=BODY | {"stream": True}))
                long_was_running = not long.done()
                return await long, waited, streamed, long_was_running

        long, waited, streamed, long_was_running = asyncio.run(run())
        assert long.status_code == 200
        assert waited.status_code == 503 and waited.json()["error"]["code"] == "queue_timeout"
        # A stream's status line went out at once: the timeout is its error event.
        assert streamed.status_code == 200
        assert [e["error"]["code"] for e in parse_events(streamed.text)] == ["queue_timeout"]
        # Ended at the timeout, not when the long request did (its 60 steps last 6 s at least, whatever the machine).
        assert long_was_running
        m = wait_for_idle(url)
        assert m['paged_jax:request_success_total{finished_reason="queue_timeout"}'] == 2
        blocks = {state: m[f'paged_jax:num_kv_cache_blocks{{state="{state}"}}'] for state in ("used", "free", "cached")}
        assert blocks["used"] == 0 and blocks["free"] + blocks["cached"] == 63


def test_failing_steps_open_the_breaker_and_a_healthy_probe_closes_it(tiny_chat_model):
    app, server = serve(tiny_chat_model, breaker_threshold=2)
    engine = app.state  # filled in by the lifespan
    with server as url:
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=TIMEOUT).status_code == 200
        runner = engine.engine.engine.runner
        healthy = runner.dispatch
        runner.dispatch = fail_on_host
        for _ in range(2):
            r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=TIMEOUT)
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        ready = httpx.get(f"{url}/ready", timeout=TIMEOUT)  # probes, and the probe fails too
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "circuit_open"
        refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=TIMEOUT)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "circuit_open"
        assert int(refused.headers["Retry-After"]) >= 1
        m = metrics(url)
        assert m["paged_jax:circuit_breaker_open"] == 1 and m["paged_jax:circuit_breaker_trips_total"] == 1
        assert m['paged_jax:request_rejected_total{cause="circuit_open"}'] == 1

        runner.dispatch = healthy
        assert httpx.get(f"{url}/ready", timeout=TIMEOUT).status_code == 200
        assert metrics(url)["paged_jax:circuit_breaker_open"] == 0
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=TIMEOUT).status_code == 200

        # A dead engine loop opens it for good.
        engine.engine.shutdown()
        assert httpx.get(f"{url}/ready", timeout=TIMEOUT).json()["error"]["message"] == (
            "not ready: the engine loop is not running")
        assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=TIMEOUT).status_code == 503
        assert metrics(url)["paged_jax:circuit_breaker_open"] == 1
