"""The waiting-queue cap (--max-num-queued-reqs) on a tiny model: beyond it a request gets 429 with
Retry-After (the official client's RateLimitError), every request accepted before still runs to its end,
and the KV blocks all come back."""

import asyncio
import time

import httpx
import openai
import pytest

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, parse_events, stream_text, wait_for_idle

MAX_NUM_SEQS = 2
QUEUE_CAP = 2


@pytest.fixture(scope="module")
def base(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(block_size=16, num_blocks=64, max_num_seqs=MAX_NUM_SEQS))
    with running_server(build_app(engine, ServerConfig(served_model_name="tiny", max_num_queued_reqs=QUEUE_CAP))) as url:
        yield url


def test_requests_beyond_the_queue_get_429_and_accepted_ones_finish(base):
    # Long enough that nothing finishes while the refused requests are sent, on a fast machine too.
    body = dict(model="tiny", max_tokens=400, ignore_eos=True, temperature=0, stream=True)

    async def accepted(http: httpx.AsyncClient, i: int) -> dict[int, str]:
        r = await http.post("/v1/completions", json=body | {"prompt": [100 + i] * 10})
        assert r.status_code == 200
        return stream_text(parse_events(r.text))

    async def run():
        async with httpx.AsyncClient(base_url=base, timeout=TIMEOUT) as http:
            tasks = [asyncio.ensure_future(accepted(http, i)) for i in range(MAX_NUM_SEQS + QUEUE_CAP)]
            deadline = time.monotonic() + TIMEOUT
            while True:
                m = metrics(base)
                if (m["paged_jax:num_requests_running"], m["paged_jax:num_requests_waiting"]) == (MAX_NUM_SEQS, QUEUE_CAP):
                    break
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), m
                await asyncio.sleep(0.01)

            refused = await http.post("/v1/completions", json=body | {"prompt": [7] * 10})
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
            with pytest.raises(openai.RateLimitError):
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            return await asyncio.gather(*tasks)

    texts = asyncio.run(run())
    assert len(texts) == MAX_NUM_SEQS + QUEUE_CAP and all(len(t) == 1 for t in texts)
    m = wait_for_idle(base)
    assert m['paged_jax:request_rejected_total{cause="queue_full"}'] == 2
    assert m['paged_jax:request_success_total{finished_reason="length"}'] == MAX_NUM_SEQS + QUEUE_CAP
    assert m['paged_jax:num_kv_cache_blocks{state="free"}'] + m['paged_jax:num_kv_cache_blocks{state="cached"}'] == 63
