"""A fleet behind a real gateway: replicas of a tiny model behind LiteLLM's Router, served by
examples/fleet/gateway.py with examples/fleet/litellm_config.yaml's router settings, driven with the
official openai client.

- A replica killed (SIGKILL) mid-traffic loses no request: the gateway sends what it dropped to the
  other replica, whose own metrics count each request once.
- A replica whose circuit breaker is open (503, as while it drains) is cooled down: traffic goes to the
  other, then comes back once the breaker closes and the cooldown ends. With every replica of a group
  refusing, the fallback group answers.
- A canary at a tenth of the weight gets a tenth of 500 requests (within 4 points), and its own latency
  histogram counts them.

No bound here is on how fast the machine is: clients wait TIMEOUT, and the cooldown test's bound on
refused requests grows with the time the traffic took.
"""

import collections
import contextlib
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import yaml

from conftest import fail_on_host, running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT, metrics, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "fleet"))
import gateway  # noqa: E402

SETTINGS = yaml.safe_load((REPO / "examples" / "fleet" / "litellm_config.yaml").read_text())["router_settings"]
COOLDOWN_S = 15  # the example's 30 s, halved: the test waits one out
CONCURRENCY = 16


def replica(tiny_chat_model, **config):
    """(app, the server's context manager) of one in-thread replica serving "tiny"."""
    engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                       EngineConfig(block_size=16, num_blocks=256, max_num_seqs=CONCURRENCY))
    app = build_app(engine, ServerConfig(served_model_name="tiny", **config))
    return app, running_server(app)


@contextlib.contextmanager
def replica_process(folder: Path, log: Path):
    """A replica as its own process (`python -m paged_jax.serve`), to be killed; yields (process, URL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "paged_jax.serve", "--model", str(folder), "--port", str(port),
         "--served-model-name", "tiny", "--num-gpu-blocks-override", "256", "--max-num-seqs", str(CONCURRENCY),
         "--disable-uvicorn-access-log", "--log-level", "warning"],
        cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                httpx.get(f"{url}/health", timeout=TIMEOUT)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        wait_until_ready(url)
        yield process, url
    finally:
        process.kill()
        process.wait()


@contextlib.contextmanager
def fleet(groups: dict[str, list[tuple[str, str, int]]], **settings):
    """The gateway over `groups` (name -> [(deployment id, replica URL, weight)]), with the example's
    router settings and `settings` over them; yields (an openai client of it, its Router)."""
    model_list = [dict(model_name=group, model_info=dict(id=id_),
                       litellm_params=dict(model="openai/tiny", api_base=f"{url}/v1", api_key="none", weight=weight,
                                           max_retries=0))
                  for group, deployments in groups.items() for id_, url, weight in deployments]
    router = gateway.make_router(dict(model_list=model_list,
                                      router_settings=SETTINGS | dict(cooldown_time=COOLDOWN_S) | settings))
    with running_server(gateway.build_app(router)) as url:
        # No retries of the client's own: what fails over is the gateway's doing.
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0), router


def complete(client: openai.OpenAI, i: int, model: str = "tiny") -> str:
    """One completion through the gateway; the id of the deployment that answered it."""
    raw = client.completions.with_raw_response.create(model=model, prompt=f"request {i}:", max_tokens=2,
                                                      temperature=0)
    completion = raw.parse()
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.completion_tokens >= 1
    return raw.headers["x-litellm-model-id"]


def successes(url: str) -> int:
    return int(sum(v for k, v in metrics(url).items() if k.startswith("paged_jax:request_success_total")))


def refusals(url: str) -> int:
    return int(metrics(url).get('paged_jax:request_rejected_total{cause="circuit_open"}', 0))


@contextlib.contextmanager
def breaker_open(app, url: str):
    """The replica's engine failing every step until its breaker opens (threshold 2), healed on the way out."""
    runner = app.state.engine.engine.runner
    healthy = runner.dispatch
    runner.dispatch = fail_on_host
    try:
        for _ in range(2):
            assert httpx.post(f"{url}/v1/completions", json=dict(model="tiny", prompt="x", max_tokens=1),
                              timeout=TIMEOUT).status_code == 500
        assert httpx.get(f"{url}/ready", timeout=TIMEOUT).status_code == 503
        yield
    finally:
        runner.dispatch = healthy
        assert httpx.get(f"{url}/ready", timeout=TIMEOUT).status_code == 200  # a probe closes it


def test_a_replica_killed_mid_traffic_loses_no_request(tiny_chat_model, tiny_chat_folder, tmp_path):
    _, server = replica(tiny_chat_model)
    with replica_process(tiny_chat_folder, tmp_path / "replica.log") as (doomed, first), server as second:
        with fleet({"tiny": [("first", first, 1), ("second", second, 1)]}) as (client, _):
            before = successes(second)
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                answers = [pool.submit(complete, client, i) for i in range(500)]  # the 500 at 16
                while sum(a.done() for a in answers) < 100:
                    time.sleep(0.05)
                doomed.kill()  # with about CONCURRENCY / 2 requests in flight on it
                answered_by = collections.Counter(a.result() for a in answers)  # raises if one failed
            assert answered_by["first"] > 0 and answered_by["first"] + answered_by["second"] == 500
            # Each request the survivor answered for the gateway, it ran once: no retry ran twice.
            assert successes(second) - before == answered_by["second"]


def test_a_replica_with_its_breaker_open_is_cooled_down_and_returns(tiny_chat_model):
    (app, server), (_, other_server) = replica(tiny_chat_model, breaker_threshold=2), replica(tiny_chat_model)
    with server as broken, other_server as other:
        with fleet({"tiny": [("broken", broken, 1), ("other", other, 1)]}) as (client, _):
            with breaker_open(app, broken):
                refused, start = refusals(broken), time.monotonic()
                answered_by = collections.Counter(complete(client, i) for i in range(40))
                refused, elapsed = refusals(broken) - refused, time.monotonic() - start
                assert answered_by == {"other": 40}
                # The gateway met the 503 and stopped sending there: after the second refusal in a minute
                # (allowed_fails 1), once per cooldown. Without cooldowns, about half the 40 would meet it.
                assert 1 <= refused <= 2 * (2 + elapsed // COOLDOWN_S), (refused, elapsed)
            deadline = time.monotonic() + COOLDOWN_S + 300
            while "broken" not in {complete(client, i) for i in range(4)}:  # back once the cooldown ends
                assert time.monotonic() < deadline, "the healed replica got no traffic back"
                time.sleep(1)

        # A group whose every replica refuses: its fallback group answers.
        with fleet({"tiny": [("broken", broken, 1)], "tiny-fallback": [("fallback", other, 1)]},
                   fallbacks=[{"tiny": ["tiny-fallback"]}]) as (client, _):
            with breaker_open(app, broken):
                assert {complete(client, i) for i in range(5)} == {"fallback"}


def test_a_canary_gets_its_weight_of_the_traffic(tiny_chat_model):
    (_, stable_server), (_, canary_server) = replica(tiny_chat_model), replica(tiny_chat_model)
    with stable_server as stable, canary_server as canary:
        with fleet({"tiny": [("stable", stable, 9), ("canary", canary, 1)]}) as (client, _):
            random.seed(0)  # simple-shuffle draws with random.choices: the same draws every run
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                answered_by = collections.Counter(pool.map(lambda i: complete(client, i), range(500)))
        share = answered_by["canary"] / 500
        assert 0.06 <= share <= 0.14, answered_by
        for name, url in (("canary", canary), ("stable", stable)):
            m = metrics(url)
            # Each side's own latency histogram holds its requests, to compare the canary's with the stable's.
            assert m["paged_jax:e2e_request_latency_seconds_count"] == answered_by[name] == successes(url)


def test_a_stream_through_the_gateway_says_what_the_replica_says(tiny_chat_model):
    _, server = replica(tiny_chat_model)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    with server as url, fleet({"tiny": [("only", url, 1)]}) as (client, _):
        direct = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        for kind in ("chat", "completion"):
            if kind == "chat":
                ask = dict(model="tiny", messages=messages, max_tokens=24, temperature=0)
                expected = direct.chat.completions.create(**ask).choices[0].message.content
                chunks = list(client.chat.completions.create(**ask, stream=True))
                streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                ask = dict(model="tiny", prompt="The sea is", max_tokens=24, temperature=0)
                expected = direct.completions.create(**ask).choices[0].text
                chunks = list(client.completions.create(**ask, stream=True))
                streamed = "".join(c.choices[0].text or "" for c in chunks if c.choices)
            assert len(chunks) > 2 and expected and streamed == expected, (kind, streamed, expected)
