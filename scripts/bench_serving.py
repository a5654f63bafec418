"""Online serving benchmark: replay a workload (default ../shared/workloads/w1.json) against the server
with Poisson arrivals, and report what `vllm bench serve` reports.

    python scripts/bench_serving.py --request-rate 2 --request-rate inf --json out/serving.json
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 2

Without --base-url it starts `python -m paged_jax.serve --model MODEL` (plus --server-args) on a free
port and stops it at the end. Each request streams a completion of its prompt token ids with greedy
decoding and EOS ignored, so it generates exactly its max_new_tokens. Per rate: request and token
throughput; TTFT, TPOT (after the first token), ITL (between streamed chunks) and end-to-end latency at
mean, median, p95 and p99; and the server's compiles during the run (from /metrics), which would
distort the figures.
"""

import argparse
import asyncio
import json
import pathlib
import random
import shlex
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from paged_jax.research import machine

DEFAULT_WORKLOAD = pathlib.Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1.json"
REPO = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    p.add_argument("--request-rate", type=float, action="append",
                   help="requests per second, Poisson arrivals; inf sends all at once (repeatable; default 2)")
    p.add_argument("--base-url", help="a running server; without it one is started")
    p.add_argument("--model", default="smollm2-135m", help="for the server this script starts")
    p.add_argument("--server-args", default="", help="more flags for the server this script starts")
    p.add_argument("--num-requests", type=int, help="first N requests only")
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="workload requests sent once, all at once, before timing (compiles happen there)")
    p.add_argument("--seed", type=int, default=0, help="for the arrival times")
    p.add_argument("--json", help="write the results to this path")
    return p.parse_args(argv)


async def one_request(http: httpx.AsyncClient, request: dict) -> dict:
    """Stream one completion; client-side timings (s) of its chunks and its token counts."""
    body = dict(prompt=request["prompt_token_ids"], max_tokens=request["max_new_tokens"], temperature=0,
                ignore_eos=True, stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    chunk_times, usage = [], None
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
    end = time.perf_counter()
    if not chunk_times or usage is None:
        return {"error": "the stream ended without output or usage"}
    return {"ttft": chunk_times[0] - start, "e2e": end - start, "itls": np.diff(chunk_times).tolist(),
            "prompt_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


async def replay(base_url: str, requests: list[dict], rate: float, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(3600), limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one_request(http, request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[dict], duration: float, rate: float) -> dict:
    ok = [r for r in results if "error" not in r]
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
        "tpot_ms": ms([(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]),
        "itl_ms": ms([x for r in ok for x in r["itls"]]),
        "e2e_ms": ms([r["e2e"] for r in ok]),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
    }


def server_compiles(base_url: str) -> float:
    lines = httpx.get(f"{base_url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("paged_jax:num_compiles_total"))


def print_summary(s: dict) -> None:
    print(f"{'=' * 16} Serving benchmark, request rate {s['request_rate']} {'=' * 16}")
    for key in ("successful_requests", "failed_requests", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "compiles_during_run"):
        print(f"{key:<40}{s[key]}")
    for key, title in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token (after the first)"),
                       ("itl_ms", "inter-token latency"), ("e2e_ms", "end-to-end latency")):
        print(f"--- {title} (ms)")
        for stat, value in s[key].items():
            print(f"  {stat:<38}{value}")
    for error in s["errors"]:
        print(f"error: {error}")


def start_server(model: str, extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "paged_jax.serve", "--model", model, "--port", str(port),
                               "--disable-uvicorn-access-log", "--log-level", "warning", *shlex.split(extra)], cwd=REPO)
    base_url = f"http://127.0.0.1:{port}"
    while True:
        if server.poll() is not None:
            sys.exit(f"bench_serving.py: the server exited with {server.returncode}")
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                return server, base_url
        except httpx.TransportError:
            time.sleep(0.5)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    where = machine.describe()
    print(machine.one_line(where))
    requests = json.loads(pathlib.Path(args.workload).read_text())["requests"][: args.num_requests]
    server, base_url = (None, args.base_url) if args.base_url else start_server(args.model, args.server_args)
    try:
        if args.warmup_requests:
            asyncio.run(replay(base_url, requests[: args.warmup_requests], float("inf"), args.seed))
        summaries = []
        for rate in args.request_rate or [2.0]:
            compiles = server_compiles(base_url)
            results, duration = asyncio.run(replay(base_url, requests, rate, args.seed))
            summary = summarize(results, duration, rate)
            summary["compiles_during_run"] = server_compiles(base_url) - compiles
            print_summary(summary)
            summaries.append(summary)
    finally:
        if server is not None:
            server.terminate()
            server.wait(120)
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps({"machine": where, "workload": args.workload, "runs": summaries}, indent=2))
    return summaries


if __name__ == "__main__":
    main()
