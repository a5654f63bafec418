"""The client side of bench_serving.py: a workload replayed against an OpenAI-compatible server with
Poisson arrivals, each request a streamed completion timed at the client, and the figures `vllm bench
serve` reports (throughput; TTFT, TPOT, ITL and end-to-end latency at mean, median, p95 and p99;
goodput against objectives)."""

import asyncio
import json
import random
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families


async def one_request(http: httpx.AsyncClient, request: dict, model: str, stream: bool = True) -> dict:
    """One completion, streamed or not; client-side timings (s) of its chunks, its token counts and
    its text (a non-streamed answer is one chunk: its TTFT is its end-to-end latency)."""
    body = dict(model=model, prompt=request["prompt_token_ids"], max_tokens=request["max_new_tokens"], temperature=0,
                ignore_eos=True, stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    start = time.perf_counter()
    chunk_times, usage, text = [], None, []
    if not stream:
        r = await http.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {r.text[:200]}"}
        answer = r.json()
        chunk_times, usage, text = [time.perf_counter()], answer["usage"], [answer["choices"][0]["text"]]
    else:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {(await r.aread()).decode()[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk.get("choices"):
                    chunk_times.append(time.perf_counter())
                    text.append(chunk["choices"][0]["text"])
    end = time.perf_counter()
    if not chunk_times or usage is None:
        return {"error": "the stream ended without output or usage"}
    return {"ttft": chunk_times[0] - start, "e2e": end - start, "itls": np.diff(chunk_times).tolist(),
            "prompt_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"], "text": "".join(text)}


async def closed_loop(base_url: str, requests: list[dict], concurrency: int, model: str) -> tuple[list[dict], float]:
    """The requests kept `concurrency` in flight (each sent as one ends), every other one streamed;
    their results in order, and the seconds from the first sent to the last answered."""
    results: list[dict | None] = [None] * len(requests)
    queue = iter(enumerate(requests))
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as http:
        async def worker():
            for i, request in queue:  # one shared iterator: each request taken by one worker
                results[i] = await one_request(http, request, model, stream=i % 2 == 0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - start


def server_counters(base_url: str, names: tuple[str, ...]) -> dict[str, float]:
    """A paged_jax server's counters from /metrics, by name without its prefix and suffix
    (paged_jax:num_compiles_total is num_compiles; a histogram's name gives its count)."""
    found = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for s in family.samples:
            name = s.name.removeprefix("paged_jax:").removesuffix("_total").removesuffix("_count")
            if s.name.startswith("paged_jax:") and name in found:
                found[name] += s.value
    return found


async def replay(base_url: str, requests: list[dict], rate: float, seed: int, model: str) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one_request(http, request, model)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def tpot(r: dict) -> float | None:
    return (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) if r["output_tokens"] > 1 else None


def within(r: dict, objectives: dict[str, float]) -> bool:
    """Whether a successful request met every objective (ms); one with a single token has no TPOT."""
    measured = {"ttft": r["ttft"], "tpot": tpot(r), "e2e": r["e2e"]}
    return all(measured[key] is None or 1000 * measured[key] <= ms for key, ms in objectives.items())


def summarize(results: list[dict], duration: float, rate: float, goodput: dict[str, float]) -> dict:
    ok = [r for r in results if "error" not in r]
    good = [r for r in ok if within(r, goodput)]
    ms = lambda values: {name: round(1000 * float(f(values)), 2) if len(values) else None for name, f in (
        ("mean", np.mean), ("median", np.median), ("p95", lambda v: np.percentile(v, 95)),
        ("p99", lambda v: np.percentile(v, 99)))}
    output_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = sum(r["prompt_tokens"] for r in ok)
    return {
        "request_rate": rate if rate != float("inf") else "inf",
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "duration_s": round(duration, 2), "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(output_tokens / duration, 1),
        "total_token_throughput": round((prompt_tokens + output_tokens) / duration, 1),
        "ttft_ms": ms([r["ttft"] for r in ok]),
        "tpot_ms": ms([tpot(r) for r in ok if r["output_tokens"] > 1]),
        "itl_ms": ms([x for r in ok for x in r["itls"]]),
        "e2e_ms": ms([r["e2e"] for r in ok]),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
    } | ({"goodput_objectives_ms": goodput, "good_requests": len(good), "goodput": round(len(good) / duration, 3)}
         if goodput else {})


def print_summary(s: dict) -> None:
    print(f"{'=' * 16} {s['system']}, request rate {s['request_rate']} {'=' * 16}")
    for key in ("successful_requests", "failed_requests", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "compiles_during_run",
                "compiles_so_far", "good_requests", "goodput"):
        if key in s:
            print(f"{key:<40}{s[key]}")
    for key, title in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token (after the first)"),
                       ("itl_ms", "inter-token latency"), ("e2e_ms", "end-to-end latency")):
        print(f"--- {title} (ms)")
        for stat, value in s[key].items():
            print(f"  {stat:<38}{value}")
    for error in s["errors"]:
        print(f"error: {error}")
