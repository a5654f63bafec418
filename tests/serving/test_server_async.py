"""The server with asynchronous scheduling on (the engine a step ahead), through the official `openai`
client: the same completions as a server without it, streamed or not, and a client that leaves
mid-stream frees its blocks while a step is in flight."""

import contextlib

import httpx
import openai

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, wait_for_idle

MODEL = "tiny"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]


@contextlib.contextmanager
def server(tiny_chat_model, async_scheduling: bool):
    m = tiny_chat_model
    engine = LLMEngine(m.model, m.config, m.tokenizer,
                       EngineConfig(block_size=8, num_blocks=128, async_scheduling=async_scheduling))
    assert engine.resolved.async_scheduling == async_scheduling
    with running_server(build_app(engine, ServerConfig(served_model_name=MODEL))) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def completions(client: openai.OpenAI) -> list:
    """Greedy text, seeded samples, a stop string, logprobs: each streamed and not."""
    asks = [dict(prompt=PROMPTS, max_tokens=12, temperature=0),
            dict(prompt=PROMPTS[0], max_tokens=10, temperature=1.0, seed=4, n=2),
            dict(prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=["e"]),
            dict(prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=2)]
    out = []
    for ask in asks:
        r = client.completions.create(model=MODEL, **ask)
        out.append([(c.index, c.text, c.finish_reason) for c in r.choices])
        texts: dict[int, str] = {}
        for chunk in client.completions.create(model=MODEL, stream=True, **ask):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        out.append(sorted(texts.items()))
    return out


def test_a_step_ahead_serves_what_the_synchronous_server_serves(tiny_chat_model):
    with server(tiny_chat_model, False) as (_, client):
        expected = completions(client)
    with server(tiny_chat_model, True) as (url, client):
        assert completions(client) == expected
        free = wait_for_idle(url)
    assert free['paged_jax:num_kv_cache_blocks{state="used"}'] == 0


def test_a_client_that_leaves_mid_stream_frees_its_blocks(tiny_chat_model):
    with server(tiny_chat_model, True) as (url, _):
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert r.status_code == 200
            for _ in range(6):
                next(lines)
        after = wait_for_idle(url)
        assert after['paged_jax:num_kv_cache_blocks{state="used"}'] == 0
        assert metrics(url)['paged_jax:request_success_total{finished_reason="abort"}'] == 1
