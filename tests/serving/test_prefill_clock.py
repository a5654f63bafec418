"""Admission by SLO on a cold replica: the prefill clock (a probe step after the warm-up, refined by the
steps that follow) lets the first burst a replica meets be shed by the work ahead in tokens, before any
request has finished to measure a service rate."""

import asyncio

import httpx
import pytest

from conftest import running_server, slow_steps
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.prefill_clock import PrefillClock
from paged_jax.serving.server import ServerConfig, build_app
from server_client import metrics, wait_until_ready

TIMEOUT = 300.0  # generous: the test checks what the server decides, never how fast it runs
STEP_DELAY_S = 0.1  # each step lasts this long at least, so a token costs at least 0.1 s / 256
PROMPT = 240
BURST = 24


def test_the_clock_starts_from_the_probe_and_follows_prefill_steps_only():
    clock = PrefillClock(tau=4.0)
    assert clock.seconds_per_token is None
    clock.observe(0.5, 250)  # the probe: a full step
    assert clock.seconds_per_token == pytest.approx(0.002)
    clock.observe(0.2, 8)  # decodes: a cost per sequence, not per prompt token
    assert clock.seconds_per_token == pytest.approx(0.002)
    clock.observe(1.0, 250)  # a slower prefill moves it a quarter of the way
    assert clock.seconds_per_token == pytest.approx(0.002 + (0.004 - 0.002) / 4)


async def first_chunk(http: httpx.AsyncClient, prompt: list[int]) -> httpx.Response:
    body = dict(model="tiny", prompt=prompt, max_tokens=4, ignore_eos=True, temperature=0, stream=True)
    async with http.stream("POST", "/v1/completions", json=body) as r:
        await r.aread()
        return r


def test_a_burst_on_a_replica_just_ready_is_shed_by_the_work_ahead(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(block_size=16, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256))
    slow_steps(engine, STEP_DELAY_S)
    app = build_app(engine, ServerConfig(served_model_name="tiny", slo_ttft_ms=1500))
    with running_server(app) as url:
        wait_until_ready(url)
        assert metrics(url)["paged_jax:slo_service_rate"] == 0  # nothing served: no rate to go by

        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                # Distinct prompts: nothing comes from the prefix cache.
                return await asyncio.gather(*(first_chunk(http, [1000 + i] * PROMPT) for i in range(BURST)))

        results = asyncio.run(burst())
    codes = [r.status_code for r in results]
    # The k-th in line (from 0) has 240 k tokens ahead at >= 0.39 ms each (the probe's step took >= 0.1 s
    # for 256 tokens), so from k = 16 on it cannot meet 1.5 s (8 of 24 at least, when all arrive
    # before the first starts); the first is always let in.
    print("burst on a cold replica:", codes.count(200), "admitted,", codes.count(429), "shed")
    assert set(codes) == {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and b"slo_unattainable" in r.content
