"""Prefix-aware placement (examples/fleet/prefix_router.py, scripts/bench_placement.py) over two in-thread
replicas of a tiny model publishing KV-cache events: the router's picture of each replica's blocks is
the replica's own prefix cache, a request goes where its prefix is held (even to the busier replica),
and the replay runs both policies over the same requests. No figure here is a speed."""

import asyncio
import contextlib
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.kv_events import KVEventsConfig
from paged_jax.serving.server import ServerConfig, build_app
from server_client import TIMEOUT

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "fleet"))
sys.path.insert(0, str(REPO / "scripts"))
import bench_placement  # noqa: E402
from prefix_router import PrefixRouter  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def replicas(tiny_chat_model, tmp_path_factory):
    """Two servers publishing KV-cache events: [(URL, app, PUB endpoint)]."""
    folder = tmp_path_factory.mktemp("placement")
    with contextlib.ExitStack() as stack:
        out = []
        for k in range(2):
            endpoint = f"ipc://{folder}/replica-{k}"
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
            engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                               EngineConfig(block_size=BLOCK, num_blocks=40, max_num_seqs=4, max_model_len=256))
            app = build_app(engine, ServerConfig(served_model_name="tiny", kv_events=events))
            out.append((stack.enter_context(running_server(app)), app, endpoint))
        yield out


def complete(url: str, prompt: list[int]) -> None:
    r = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json=dict(
        model="tiny", prompt=prompt, max_tokens=4, ignore_eos=True, temperature=0))
    assert r.status_code == 200, r.text


def own_blocks(app) -> set[int]:
    """The replica's prefix cache, its names as they go on the wire (unsigned 64-bit)."""
    return asyncio.run(app.state.engine.call(lambda e: {n & (2**64 - 1) for n in e.blocks.cache.names()}))


def reset(app) -> None:
    asyncio.run(app.state.engine.call(lambda e: e.blocks.reset_prefix_cache()))


def wait_for_picture(router: PrefixRouter, replicas) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        with router.lock:
            if all(set(router.keys[k]) == own_blocks(app) for k, (_, app, _) in enumerate(replicas)):
                return
        assert time.monotonic() < deadline, "the router's picture never matched the replicas' prefix caches"
        time.sleep(0.1)


def test_a_request_goes_to_the_replica_holding_its_prefix(replicas):
    router = PrefixRouter([endpoint for _, _, endpoint in replicas])
    time.sleep(1)  # ZMQ's slow joiner: the subscriptions take hold before anything is published
    (a, _, _), (b, app_b, _) = replicas
    system = list(range(300, 348))  # 3 blocks
    complete(b, system + [7] * 10)
    for i in range(4):  # on A, more than its 39 usable blocks hold: A evicts
        complete(a, [1000 + 50 * i + j for j in range(150)])
    wait_for_picture(router, replicas)
    assert router.matched_blocks(1, system + [9] * 30) == 3 and router.matched_blocks(0, system) == 0
    assert router.pick(system + [9] * 30, load=[0, 5]) == 1  # the prefix outweighs B's load
    assert router.pick([5] * 64, load=[0, 5]) == 0 and router.pick([5] * 64, load=[3, 1]) == 1  # none held
    reset(app_b)
    wait_for_picture(router, replicas)  # AllBlocksCleared
    assert router.matched_blocks(1, system) == 0 and not router.keys[1]


def test_the_replay_runs_both_policies_over_the_same_requests(replicas):
    urls = [url for url, _, _ in replicas]
    prompts = bench_placement.build_workload(bench_placement.tokenizer_of(urls[0], "tiny"), groups=2, prefix=40,
                                             conversations=2, turns=2, turn=8)
    assert len(prompts) == 8 and len({tuple(p[:40]) for p in prompts}) == 2  # two groups' system prompts
    results = {}
    for policy in ("round-robin", "prefix"):
        for _, app, _ in replicas:
            reset(app)
        router = PrefixRouter([endpoint for _, _, endpoint in replicas]) if policy == "prefix" else None
        time.sleep(1)  # ZMQ's slow joiner
        results[policy] = asyncio.run(bench_placement.replay(urls, router, prompts, 0.5, "tiny", 2))
    rr, prefix = results["round-robin"], results["prefix"]
    assert rr["placed"] == [4, 4] and sum(prefix["placed"]) == 8 and rr["requests"] == prefix["requests"] == 8
    # Turn 2 of each conversation extends turn 1: by prefix it meets its own 40 + 8 tokens' blocks.
    assert prefix["hit_rate_usage"] > 0 and prefix["hit_rate_metrics"] > 0
    assert all(r["ttft_median_s"] <= r["ttft_p90_s"] for r in results.values())
