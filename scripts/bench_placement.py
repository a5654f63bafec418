"""Prefix-aware placement against round-robin over two replicas: a shared-prefix replay (issue 40).

    PYTHONPATH=. python scripts/bench_placement.py                      # SmolLM2-135M, about 4 minutes

The workload: GROUPS system prompts of PREFIX tokens (the sources of Python's own standard library
modules, so the text is real and fixed), each with CONVERSATIONS conversations of TURNS user turns, each
turn's prompt the previous one's plus a new user message (TURN tokens, from other modules' sources).
Turn t of every conversation arrives, in a seeded shuffle, every INTERVAL seconds, before turn t + 1 of
any: requests of a group come back to it while other groups' requests compete for the cache. Prompts
are token ids, tokenized once by a replica's /tokenize (what a router that tokenizes would see).

Each policy gets two fresh replicas (`python -m paged_jax.serve`, KV-cache events on, a pool small
enough that one replica cannot hold every group) and the same requests at the same times:
- round-robin: request i to replica i mod 2;
- prefix: examples/fleet/prefix_router.py, fed by the replicas' KV-cache events, sends each request to
  the replica holding the longest prefix of it (ties to the one with fewer requests in flight).
Per policy: the prefix-cache hit rate (usage.prompt_tokens_details.cached_tokens over prompt tokens, and
the replicas' own vllm:prefix_cache_hits_total / queries_total), TTFT median and p90 (streamed), and how
many requests each replica got.
"""

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from paged_jax.research import machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "fleet"))
from prefix_router import PrefixRouter  # noqa: E402

PREFIX_MODULES = ("json.decoder", "collections", "heapq", "functools", "textwrap", "argparse", "string", "bisect")
TURN_MODULES = ("difflib", "shlex", "fractions", "calendar")
TIMEOUT = 600.0


def build_workload(tokenize, groups: int, prefix: int, conversations: int, turns: int, turn: int,
                   seed: int = 0) -> list[list[int]]:
    """Prompts (token ids) in arrival order. tokenize: text -> token ids."""
    sources = [tokenize(inspect.getsource(importlib.import_module(m)))[:prefix] for m in PREFIX_MODULES[:groups]]
    assert len(sources) == groups, f"at most {len(PREFIX_MODULES)} groups"
    messages = [t for m in TURN_MODULES for t in tokenize(inspect.getsource(importlib.import_module(m)))]
    chats = [list(sources[g]) for g in range(groups) for _ in range(conversations)]
    rng, out, at = random.Random(seed), [], 0
    for _ in range(turns):
        for c in rng.sample(range(len(chats)), len(chats)):
            chats[c] += messages[at : at + turn]
            at += turn
            out.append(list(chats[c]))
    return out


async def send(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: its TTFT (seconds) and its usage."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0, stream=True,
                stream_options=dict(include_usage=True))
    start, ttft, usage = time.perf_counter(), None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return dict(ttft=ttft, prompt=usage["prompt_tokens"], cached=usage["prompt_tokens_details"]["cached_tokens"])


def prefix_counters(url: str) -> tuple[float, float]:
    """(vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total) of a replica, in tokens."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["vllm:prefix_cache_hits_total"], values["vllm:prefix_cache_queries_total"]


async def replay(urls: list[str], router: PrefixRouter | None, prompts: list[list[int]], interval: float,
                 model: str, max_tokens: int) -> dict:
    """Send prompts[i] at i * interval seconds, to replica i mod len(urls) (router None) or as the router
    picks; the per-policy figures."""
    before = [prefix_counters(u) for u in urls]
    load, placed = [0] * len(urls), [0] * len(urls)

    async def one(i: int, client: httpx.AsyncClient) -> dict:
        await asyncio.sleep(max(0.0, start + i * interval - time.perf_counter()))
        r = i % len(urls) if router is None else router.pick(prompts[i], load)
        load[r] += 1
        placed[r] += 1
        try:
            return await send(client, urls[r], model, prompts[i], max_tokens)
        finally:
            load[r] -= 1

    async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, client) for i in range(len(prompts))))
    wall = time.perf_counter() - start
    after = [prefix_counters(u) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    ttfts = sorted(r["ttft"] for r in results)
    return dict(requests=len(results), placed=placed, wall_s=round(wall, 1),
                hit_rate_usage=round(sum(r["cached"] for r in results) / sum(r["prompt"] for r in results), 3),
                hit_rate_metrics=round(hits / queries, 3) if queries else 0.0,
                ttft_median_s=round(statistics.median(ttfts), 3),
                ttft_p90_s=round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 3))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def replicas(model: str, serve_args: list[str], folder: Path, n: int = 2):
    """n fresh `python -m paged_jax.serve` processes, ready; yields (URLs, KV-event endpoints)."""
    procs, urls, endpoints = [], [], []
    try:
        for k in range(n):
            port, endpoint = free_port(), f"ipc://{folder}/kv-{k}-{time.monotonic_ns()}"
            events = dict(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=f"replica-{k}")
            log = (folder / f"replica-{k}.log").open("w")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "paged_jax.serve", "--model", model, "--port", str(port),
                 "--served-model-name", "m", "--kv-events-config", json.dumps(events),
                 "--disable-uvicorn-access-log", "--log-level", "warning", *serve_args],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
            endpoints.append(endpoint)
        deadline = time.monotonic() + TIMEOUT
        for proc, url, k in zip(procs, urls, range(n)):
            while True:  # ready: every step shape compiled
                assert proc.poll() is None, (folder / f"replica-{k}.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"replica {k} not ready in {TIMEOUT} s"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/ready", timeout=TIMEOUT).status_code == 200:
                        break
                time.sleep(1)
        yield urls, endpoints
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def tokenizer_of(url: str, model: str):
    return lambda text: httpx.post(f"{url}/tokenize", timeout=TIMEOUT, json=dict(
        model=model, prompt=text, add_special_tokens=False)).json()["tokens"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix", type=int, default=600, help="system prompt tokens")
    p.add_argument("--conversations", type=int, default=2, help="per group")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn", type=int, default=48, help="tokens of each user turn")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between arrivals")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--serve-args", default="--num-gpu-blocks-override 320 --block-size 16 --max-num-seqs 4 "
                   "--max-num-batched-tokens 256 --max-model-len 1024",
                   help="for both replicas: 320 blocks of 16 tokens hold about half the groups and their chats")
    args = p.parse_args(argv)
    print(machine.one_line(machine.describe()), flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("round-robin", "prefix"):
            with replicas(args.model, args.serve_args.split(), Path(tmp)) as (urls, endpoints):
                prompts = build_workload(tokenizer_of(urls[0], "m"), args.groups, args.prefix,
                                         args.conversations, args.turns, args.turn)
                router = PrefixRouter(endpoints) if policy == "prefix" else None
                results[policy] = asyncio.run(replay(urls, router, prompts, args.interval, "m", args.max_tokens))
                print(json.dumps(dict(policy=policy, **results[policy])), flush=True)


if __name__ == "__main__":
    main()
