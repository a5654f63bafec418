"""Ready means compiled: /health answers while the engine loop runs, /ready only once it has warmed up,
a request sent sooner waits for the warm-up, and after /ready a varied workload over HTTP (prompts up
to the context length, full batches, chunked prefill, prefix hits, preemption, n > 1, logprobs, every
sampling option, streamed or not) compiles nothing."""

import asyncio
import random
import threading

import httpx

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving import engine_loop
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, wait_for_idle, wait_until_ready

MODEL = "tiny"
# A small pool (preemption), a small step budget (chunked prefill), a full batch of 8.
ENGINE = dict(block_size=16, num_blocks=24, max_num_seqs=8, max_num_batched_tokens=64)
COMPILES = "paged_jax:num_compiles_total"


def make_app(tiny_chat_model):
    loaded = tiny_chat_model
    return build_app(LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**ENGINE)),
                     ServerConfig(served_model_name=MODEL))


def test_ready_only_after_warm_up_and_early_requests_wait(tiny_chat_model, monkeypatch):
    release, real = threading.Event(), engine_loop.warmup.warm_up
    monkeypatch.setattr(engine_loop.warmup, "warm_up", lambda engine: release.wait(600) and real(engine))
    with running_server(make_app(tiny_chat_model)) as base, httpx.Client(base_url=base, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200
        r = http.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up"
        early = {}
        sender = threading.Thread(target=lambda: early.update(r=http.post("/v1/completions", json=dict(
            model=MODEL, prompt="hello", max_tokens=3, temperature=0))))
        sender.start()
        sender.join(1.0)
        assert sender.is_alive(), "a request sent during the warm-up must wait for it"
        release.set()
        sender.join(600)
        assert early["r"].status_code == 200 and early["r"].json()["usage"]["completion_tokens"] == 3
        assert http.get("/ready").status_code == 200


async def one(http: httpx.AsyncClient, body: dict, stream: bool) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    if stream:
        async with http.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for _ in r.aiter_lines():
                pass
    else:
        r = await http.post(path, json=body)
        assert r.status_code == 200, r.text


def bodies(max_model_len: int) -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(2, 40000) for _ in range(48)]  # three blocks later prompts find cached
    options = [dict(temperature=0), dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=1, min_p=0.1, seed=3),
               dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
               dict(temperature=0, logprobs=5), dict(temperature=1, n=3, logprobs=1),
               dict(temperature=0.7, min_tokens=3, stop_token_ids=list(range(100, 200)))]
    out = []
    for i in range(28):
        length = max_model_len - 6 if i % 9 == 8 else rng.randrange(1, 150)
        prompt = [rng.randrange(2, 40000) for _ in range(length)]
        if i % 4 == 0:
            prompt = shared + prompt[48:]
        out.append(dict(model=MODEL, prompt=prompt, max_tokens=rng.randrange(3, 7), ignore_eos=True,
                        **options[i % len(options)]))
    out.append(dict(model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=4, temperature=0))
    return out


def test_nothing_compiles_after_ready(tiny_chat_model):
    app = make_app(tiny_chat_model)
    with running_server(app) as base:
        wait_until_ready(base)
        before = metrics(base)
        max_model_len = httpx.get(f"{base}/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"]

        async def run():
            async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
                await asyncio.gather(*(one(http, body, stream=i % 2 == 1) for i, body in enumerate(bodies(max_model_len))))

        asyncio.run(run())
        after = wait_for_idle(base)
        assert after[COMPILES] == before[COMPILES], "a step compiled after /ready"
        assert after["paged_jax:num_preemptions_total"] > 0, "the pool must be short enough to preempt"
        assert after["paged_jax:prefix_cache_hits_total"] > 0
        assert after["paged_jax:engine_step_device_seconds_count"] > 0
        assert after["paged_jax:engine_step_host_seconds_sum"] > 0
