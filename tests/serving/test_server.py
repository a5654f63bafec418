"""The HTTP server on a tiny random model, over plain HTTP: its endpoints, bad input (each a 4xx with
OpenAI's error body and a message), the API key, streams that match the unstreamed answer, timeouts and
disconnects that give their KV blocks back, and a bounded load of 64 streaming clients."""

import asyncio
import random
import time

import httpx
import pytest

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.metrics import FINISH_REASONS
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, parse_events, stream_text, wait_for_idle

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_BYTES = 64 * 1024
ENGINE = dict(block_size=16, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def app(tiny_chat_model):
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer, EngineConfig(**ENGINE))
    config = ServerConfig(served_model_name=MODEL, api_key=KEY, request_timeout=300, max_tokens_cap=480,
                          max_request_bytes=MAX_BYTES)
    return build_app(engine, config)


@pytest.fixture(scope="module")
def base(app):
    with running_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    with httpx.Client(base_url=base, headers=AUTH, timeout=TIMEOUT) as c:
        yield c


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(client, path: str, **body) -> list[dict]:
    r = client.post(path, json={"model": MODEL, "stream": True, **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return parse_events(r.text)


def test_info_endpoints(base, client):
    assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200  # open without the key
    assert httpx.get(f"{base}/version", timeout=TIMEOUT).json()["version"]
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 512
    paths = httpx.get(f"{base}/openapi.json", timeout=TIMEOUT).json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"} <= set(paths)
    m = metrics(base)
    assert m['paged_jax:cache_config_info{block_size="16",cache_dtype="float32",enable_prefix_caching="True",'
             'num_gpu_blocks="255"}'] == 1


def test_tokenize_and_detokenize(client):
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["max_model_len"] == 512 and r["token_strs"][0] == "Hello"
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3 and chat["tokens"][-1] == 198  # the template's "assistant\n" generation prompt


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_text_equals_unstreamed(client, endpoint):
    """Random tokens decode to split UTF-8 characters too: the stream holds those back until whole."""
    if endpoint == "/v1/completions":
        body = dict(prompt="Once upon a time", max_tokens=40, temperature=0, ignore_eos=True)
    else:
        body = dict(messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=40, temperature=0,
                    ignore_eos=True)
    r = client.post(endpoint, json={"model": MODEL, **body})
    choice = r.json()["choices"][0]
    unstreamed = choice.get("text", choice.get("message", {}).get("content"))
    chunks = stream(client, endpoint, stream_options={"include_usage": True}, **body)
    assert stream_text(chunks[:-1]) == {0: unstreamed}
    # The same counts; the stream, second, found the prompt's whole blocks in the prefix cache.
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    cached = {"prompt_tokens_details": {"cached_tokens": (prompt_tokens - 1) // 16 * 16}}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == r.json()["usage"] | cached
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_strings_cut_the_text_streamed_or_not(client):
    body = dict(prompt=[5, 6, 7, 8], max_tokens=30, temperature=0, ignore_eos=True)
    text = complete(client, **body)["choices"][0]["text"]
    stop = text[12:15]
    cut = complete(client, stop=[stop, "never there"], **body)["choices"][0]
    assert cut["text"] == text[: text.find(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert stream_text(stream(client, "/v1/completions", stop=[stop], **body)) == {0: cut["text"]}


def test_n_samples_and_several_prompts(client):
    r = complete(client, prompt=[[1, 2, 3], [4, 5]], n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert r["usage"]["completion_tokens"] == 30 and r["usage"]["prompt_tokens"] == 3 + 2
    chunks = stream(client, "/v1/completions", prompt=[[1, 2, 3], [4, 5]], n=3, temperature=1.0, seed=7, max_tokens=5,
                    ignore_eos=True)
    assert stream_text(chunks) == {c["index"]: c["text"] for c in r["choices"]}


def test_echo_and_logprobs(client):
    r = complete(client, prompt="Hello", echo=True, max_tokens=3, temperature=0)
    assert r["choices"][0]["text"].startswith("Hello")
    r = complete(client, prompt="Hello", logprobs=2, max_tokens=4, temperature=0, ignore_eos=True)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    for top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"]):
        assert len(top) <= 2 and max(top.values()) >= chosen
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(4)]


BAD = [
    # (what, body or raw bytes, status, part of the message)
    ("malformed JSON", b'{"prompt": "hi",', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("wrong type", {"prompt": 5}, 400, "prompt"),
    ("wrong type of a number", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("huge max_tokens", {"prompt": "hi", "max_tokens": 10**12}, 400, "480"),
    ("above the context", {"prompt": list(range(100, 400)), "max_tokens": 300}, 400, "512"),
    ("negative temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("huge n", {"prompt": "hi", "n": 10**9}, 400, "n="),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("empty prompt", {"prompt": ""}, 400, "non-empty"),
    ("empty prompt list", {"prompt": []}, 400, "non-empty"),
    ("token id out of range", {"prompt": [1, 10**9]}, 400, "token ids"),
    ("too-long prompt", {"prompt": list(range(100, 700))}, 400, "512"),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, 404, "gpt-9"),
    ("unsupported parameter", {"prompt": "hi", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("unknown parameter", {"prompt": "hi", "frobnicate": True}, 400, "frobnicate"),
    ("best_of above n", {"prompt": "hi", "best_of": 4}, 400, "best_of"),
    ("priority under first come, first served", {"prompt": "hi", "priority": 1}, 400, "scheduling_policy"),
    ("timeout above the cap", {"prompt": "hi", "request_timeout": 1000}, 400, "request_timeout"),
    ("oversized body", {"prompt": "x" * MAX_BYTES}, 413, str(MAX_BYTES)),
]


@pytest.mark.parametrize("what, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_requests(client, what, body, status, message):
    if isinstance(body, bytes):
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post("/v1/completions", json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"]


BAD_CHAT = [
    ("no messages", {"messages": []}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "text"),
    ("tools", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "logprobs"),
    ("too many top_logprobs", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
     400, "top_logprobs"),
    ("max_completion_tokens above the context", {"messages": [{"role": "user", "content": "word " * 100}],
                                                 "max_completion_tokens": 480, "max_tokens": 1}, 400,
     "max_completion_tokens=480"),
]


@pytest.mark.parametrize("what, body, status, message", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests(client, what, body, status, message):
    r = client.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_api_key(base):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{base}/v1/models", headers=headers, timeout=TIMEOUT).status_code == 401
        # Checked before the body is read: a bad body without the key is still a 401.
        assert httpx.post(f"{base}/v1/completions", content=b"{", headers=headers, timeout=TIMEOUT).status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{base}{path}", timeout=TIMEOUT).status_code == 200
    lower_case = {"Authorization": f"bearer {KEY}"}
    assert httpx.get(f"{base}/v1/models", headers=lower_case, timeout=TIMEOUT).status_code == 200
    assert metrics(base)['paged_jax:request_rejected_total{cause="unauthorized"}'] >= 9
    assert "HTTPBearer" in httpx.get(f"{base}/openapi.json", timeout=TIMEOUT).json()["components"]["securitySchemes"]


def test_a_request_whose_output_handling_fails_fails_alone(app, base, client, monkeypatch):
    def broken(*args):
        raise RuntimeError("broken")

    monkeypatch.setattr(app.state.serving.logprobs, "chat", broken)
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    chunks = client.post("/v1/chat/completions", json=body | {"stream": True}).text
    assert '"type":"server_error"' in chunks and chunks.endswith("data: [DONE]\n\n")
    assert complete(client, prompt="hi", max_tokens=3)["choices"][0]["finish_reason"] == "length"
    wait_for_idle(base)


def test_timeouts_end_requests_and_free_their_blocks(base, client):
    before = metrics(base)["paged_jax:request_timeouts_total"]
    # 480 tokens take the tiny model 480 steps, well over 50 ms (0.3 s was once too long: it finished in time).
    body = dict(model=MODEL, prompt=[7] * 20, max_tokens=480, ignore_eos=True, temperature=0, request_timeout=0.05)
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 408 and "ran out of time" in r.json()["error"]["message"]
    wait_for_idle(base)
    chunks = stream(client, "/v1/completions", **body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "timeout" and len(stream_text(chunks)) == 1
    wait_for_idle(base)
    assert metrics(base)["paged_jax:request_timeouts_total"] == before + 2


def test_a_client_that_leaves_has_its_request_aborted(base):
    before = metrics(base)['paged_jax:request_success_total{finished_reason="abort"}']
    body = dict(model=MODEL, prompt=[8] * 20, max_tokens=480, ignore_eos=True, temperature=0)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=0.1)
    deadline = time.monotonic() + TIMEOUT
    while metrics(base)['paged_jax:request_success_total{finished_reason="abort"}'] == before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    wait_for_idle(base)


def test_load_of_64_streaming_clients_a_quarter_leaving(base):
    """64 concurrent streams of mixed prompt lengths through 16 running slots (so requests queue and
    get preempted); every fourth client leaves after its second chunk. Every stream that stays is
    well-formed and ends with [DONE]; the server answers /health meanwhile; afterwards nothing runs,
    nothing waits and every KV block is free or merely cached."""
    rng = random.Random(0)
    before = metrics(base)
    leavers = range(0, 64, 4)

    async def client_run(http: httpx.AsyncClient, i: int):
        if i % 8 == 1:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * rng.randint(1, 200)}]}
        else:
            path, body = "/v1/completions", {"prompt": [rng.randint(100, 40000) for _ in range(rng.randint(1, 300))]}
        body |= dict(model=MODEL, stream=True, max_tokens=120 if i in leavers else rng.randint(1, 60), temperature=0.7,
                     ignore_eos=True)
        async with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            if i in leavers:
                lines = r.aiter_lines()
                for _ in range(2):
                    await anext(lines)
                return None
            text = "".join([piece async for piece in r.aiter_text()])
        chunks = parse_events(text)
        assert len(stream_text(chunks)) == 1
        return chunks

    async def health_latency(http: httpx.AsyncClient) -> float:
        await asyncio.sleep(1.0)
        start = time.monotonic()
        assert (await http.get("/health")).status_code == 200
        return time.monotonic() - start

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=TIMEOUT, limits=limits) as http:
            return await asyncio.gather(health_latency(http), *(client_run(http, i) for i in range(64)))

    latency, *results = asyncio.run(run())
    # /health does not queue behind the engine: it answers in milliseconds while the 64 streams take tens
    # of seconds, so 10 s holds on a machine many times slower and still fails a health check that waits.
    assert latency < 10.0
    assert sum(r is not None for r in results) == 48
    after = wait_for_idle(base)
    blocks = lambda state: after[f'paged_jax:num_kv_cache_blocks{{state="{state}"}}']
    assert blocks("free") + blocks("cached") == 255 and blocks("used") == 0
    reasons = {r: after[f'paged_jax:request_success_total{{finished_reason="{r}"}}']
               - before[f'paged_jax:request_success_total{{finished_reason="{r}"}}'] for r in FINISH_REASONS}
    assert reasons == dict.fromkeys(FINISH_REASONS, 0) | {"abort": len(leavers), "length": 48}
    assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 200
