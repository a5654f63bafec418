"""How scheduling policies and budgets shape latency under Poisson and bursty arrivals: hundreds of
configurations through the real Scheduler and BlockManager on a step-cost clock (replay.py).

    python scripts/compare_policies.py --fit            # measure the engine's steps, write step_cost.json
    python scripts/compare_policies.py --engine-check 12 --out-dir docs/figures

The step-cost model (seconds = a + b * tokens computed + c * context tokens attended) is fitted by
least squares to real SmolLM2 steps on this machine (--fit, compiles excluded) and kept beside this
script in step_cost.json with the command that produced it. With --engine-check N, the first
configuration of each policy also runs through the real engine on N requests, to show how far the
cost model is off. Requests come from make_workload.py (seeded); under every policy each request
carries a priority in {0, 1, 2}, which only the priority policy reads.

A replay runs the block manager's host bookkeeping alone (replay.py). On this 2-core machine, busy with another job,

    time python scripts/compare_policies.py --out-dir /tmp/cp     # 288 configurations of 100 requests: 86 s

and docs/research.md's 144 configurations of 60 requests (its command less --engine-check) take 26 s,
against 132 s through the engine's jitted pool. --jobs N spreads the configurations over N processes
(each takes 2 s to start); --jobs 2 was no faster on that busy machine.
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import multiprocessing
import pathlib
import time

import numpy as np
from matplotlib.figure import Figure

from make_workload import make_workload
from models import DEFAULT_MODEL
from paged_jax.core.config import EngineConfig
from paged_jax.core.policy import POLICIES
from paged_jax.research.replay import Replay, Request, StepCost, replay
from step_cost import fit_step_cost

STEP_COST = pathlib.Path(__file__).with_name("step_cost.json")
PATTERNS = ("poisson", "bursty")


def arrivals(num: int, rate: float, pattern: str, rng: np.random.Generator) -> np.ndarray:
    """float64 [num]: arrival times in seconds. Poisson: exponential gaps; bursty: gamma gaps of the
    same mean with shape 0.25 (a coefficient of variation of 2, vLLM's benchmark's burstiness 0.25)."""
    shape = {"poisson": 1.0, "bursty": 0.25}[pattern]
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), size=num))


def requests_for(workload: dict, rate: float, pattern: str, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    times = arrivals(len(workload["requests"]), rate, pattern, rng)
    priorities = rng.integers(0, 3, size=len(times))
    return [Request(tuple(r["prompt_token_ids"]), r["max_new_tokens"], float(t), int(p))
            for r, t, p in zip(workload["requests"], times, priorities)]


@dataclasses.dataclass(frozen=True, slots=True)
class Setting:
    policy: str
    pattern: str
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_chunked_prefill: bool
    preemption_mode: str
    kv_tokens: int

    def engine_config(self, block_size: int) -> EngineConfig:
        return EngineConfig(block_size=block_size, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            enable_chunked_prefill=self.enable_chunked_prefill,
                            preemption_mode=self.preemption_mode, scheduling_policy=self.policy)


def summarize(result: Replay, priorities: np.ndarray) -> dict:
    """Latency percentiles (seconds), throughput and queueing of one replay or engine run."""
    ttft, tpot, e2e = result.ttft, result.tpot, result.e2e
    return dict(ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                ttft_p50_urgent=float(np.percentile(ttft[priorities == 0], 50)),
                tpot_p50=float(np.nanpercentile(tpot, 50)), tpot_p99=float(np.nanpercentile(tpot, 99)),
                e2e_p50=float(np.percentile(e2e, 50)), e2e_p99=float(np.percentile(e2e, 99)),
                throughput=result.throughput, preemptions=result.num_preemptions,
                queue_max=int(result.queue_depth.max(initial=0)), queue_mean=float(result.queue_depth.mean()))


def settings(args) -> list[Setting]:
    """The grid, less combinations the engine would refuse: a request longer than the KV budget, or,
    without chunked prefill, than one step's tokens."""
    grid = itertools.product(POLICIES, PATTERNS, args.max_num_batched_tokens, args.max_num_seqs, (True, False),
                             ("recompute", "swap"), args.kv_tokens)
    return [s for s in (Setting(*g) for g in grid)
            if s.kv_tokens >= args.longest and (s.enable_chunked_prefill or s.max_num_batched_tokens >= args.longest)]


def sweep(args, workload: dict, cost: StepCost) -> list[dict]:
    """One row per setting, in the grid's order, replayed by args.jobs processes."""
    traffic = {p: requests_for(workload, args.rate, p, args.seed) for p in PATTERNS}
    grid = settings(args)
    requests = [traffic[s.pattern] for s in grid]
    run = functools.partial(replay_row, block_size=args.block_size, cost=cost)
    if args.jobs == 1:
        return list(map(run, grid, requests))
    # Spawned, not forked: a forked JAX process may deadlock.
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(run, grid, requests, chunksize=max(1, len(grid) // (4 * args.jobs))))


def replay_row(setting: Setting, requests: list[Request], block_size: int, cost: StepCost) -> dict:
    result = replay(setting.engine_config(block_size), 1 + setting.kv_tokens // block_size, requests, cost)
    return dataclasses.asdict(setting) | summarize(result, np.array([r.priority for r in requests]))


def engine_check(args, workload: dict, cost: StepCost, setting: Setting, num: int) -> dict:
    """(replay's figures, the real engine's) for one setting on the first num requests, arriving on
    the wall clock."""
    from paged_jax import LLM, LLMEngine, SamplingParams

    # Outputs capped at 64 tokens, for both the model and the engine: the engine runs in real time.
    subset = dict(workload, requests=[dict(r, max_new_tokens=min(64, r["max_new_tokens"]))
                                      for r in workload["requests"][:num]])
    requests = requests_for(subset, args.rate, setting.pattern, args.seed)
    priorities = np.array([r.priority for r in requests])
    num_blocks = 1 + setting.kv_tokens // args.block_size
    config = dataclasses.replace(setting.engine_config(args.block_size), num_blocks=num_blocks)
    engine = LLMEngine.from_pretrained(args.model, config)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.max_tokens) for r in requests]
    LLM.from_engine(engine).generate([list(r.prompt_token_ids) for r in requests], params, use_tqdm=False)  # compiles
    engine.blocks.reset_prefix_cache()
    start, pending, done = time.monotonic(), list(range(len(requests))), {}
    ids = {}
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and requests[pending[0]].arrival_time <= now:
            i = pending.pop(0)
            priority = requests[i].priority if setting.policy == "priority" else 0
            ids[engine.add_request(list(requests[i].prompt_token_ids), params[i], priority=priority)] = i
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[pending[0]].arrival_time - now))
            continue
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.metrics
    # The engine's clock counts from when each request was added, which is its arrival here.
    metrics = [done[i] for i in range(len(requests))]
    real = Replay(
        first_token_time=np.array([m.first_token_time - start for m in metrics]),
        finish_time=np.array([m.finish_time - start for m in metrics]),
        arrival_time=np.array([m.arrival_time - start for m in metrics]),
        num_output_tokens=np.array([m.num_output_tokens for m in metrics]),
        step_time=np.zeros(0), step_tokens=np.zeros(0, int), queue_depth=np.zeros(0, int), num_running=np.zeros(0, int),
        slots_in_use=np.zeros(0, int), tokens_held=np.zeros(0, int),
        num_preemptions=engine.stats().num_preemptions, prefix_hit_tokens=0, peak_blocks_in_use=0)
    modelled = replay(setting.engine_config(args.block_size), 1 + setting.kv_tokens // args.block_size, requests, cost)
    keys = ("ttft_p50", "ttft_p99", "tpot_p50", "e2e_p50", "e2e_p99", "throughput", "preemptions")
    model_row, real_row = summarize(modelled, priorities), summarize(real, priorities)
    return dict(policy=setting.policy, pattern=setting.pattern, requests=num,
                **{f"{k}_model": model_row[k] for k in keys}, **{f"{k}_engine": real_row[k] for k in keys})


def markdown(rows: list[dict], columns: list[str]) -> str:
    def cell(value):
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], queues: dict[str, Replay], path: pathlib.Path) -> None:
    fig = Figure(figsize=(13, 4), layout="constrained")
    left, middle, right = fig.subplots(1, 3)
    for policy, result in queues.items():
        left.step(result.step_time, result.queue_depth, where="post", label=policy)
    left.set(xlabel="time (s, cost model)", ylabel="waiting sequences", title="queue depth, bursty arrivals")
    left.legend(fontsize=8)
    for policy, marker in zip(POLICIES, "os^"):
        mine = [r for r in rows if r["policy"] == policy]
        middle.scatter([r["throughput"] for r in mine], [r["ttft_p99"] for r in mine], s=10, marker=marker,
                       label=policy, alpha=0.6)
        right.scatter([r["ttft_p50"] for r in mine], [r["ttft_p50_urgent"] for r in mine], s=10, marker=marker,
                      label=policy, alpha=0.6)
    middle.set(xlabel="output tokens/s", ylabel="TTFT p99 (s)", yscale="log", title="every configuration")
    right.set(xlabel="TTFT p50, all requests (s)", ylabel="TTFT p50, priority 0 (s)", xscale="log", yscale="log",
              title="who waits")
    right.legend(fontsize=8)
    fig.savefig(path, dpi=80, bbox_inches="tight")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help=f"measure engine steps and write {STEP_COST.name}")
    parser.add_argument("--fit-requests", type=int, default=24)
    parser.add_argument("--step-cost", type=pathlib.Path, default=STEP_COST)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=0.6, help="requests per second, on average")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--kv-tokens", type=int, nargs="+", default=[4096, 16384], help="KV budgets, in tokens")
    parser.add_argument("--engine-check", type=int, default=0, metavar="N",
                        help="run one configuration per policy through the real engine on N requests")
    parser.add_argument("--jobs", type=int, default=1, help="processes replaying configurations at once")
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("out"))
    args = parser.parse_args(argv)
    if args.fit:
        fitted = fit_step_cost(args)
        args.step_cost.write_text(json.dumps(fitted, indent=1) + "\n")
        print(json.dumps(fitted, indent=1))
        return
    cost = StepCost.load(args.step_cost)
    workload = make_workload(args.num_requests, seed=args.seed)
    args.longest = max(len(r["prompt_token_ids"]) + r["max_new_tokens"] for r in workload["requests"])
    start = time.perf_counter()
    rows = sweep(args, workload, cost)
    print(f"{len(rows)} configurations replayed in {time.perf_counter() - start:.1f} s "
          f"({args.num_requests} requests, {args.rate} requests/s, step cost {cost})\n")
    base = dict(max_num_batched_tokens=args.max_num_batched_tokens[-1], max_num_seqs=args.max_num_seqs[-1],
                enable_chunked_prefill=True, preemption_mode="recompute", kv_tokens=args.kv_tokens[0])
    headline = [r for r in rows if all(r[k] == v for k, v in base.items())]
    columns = ["policy", "pattern", "ttft_p50", "ttft_p99", "ttft_p50_urgent", "tpot_p50", "tpot_p99", "e2e_p50",
               "e2e_p99", "throughput", "preemptions", "queue_max"]
    text = [f"Headline configuration: {base} (seconds; throughput in output tokens/s)\n\n"
            + markdown(headline, columns)]
    best = {}
    for r in rows:
        key = (r["policy"], r["pattern"])
        if key not in best or r["ttft_p99"] < best[key]["ttft_p99"]:
            best[key] = r
    text.append("Lowest TTFT p99 per policy and pattern over the grid\n\n" + markdown(
        list(best.values()), ["policy", "pattern", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                              "preemption_mode", "kv_tokens", "ttft_p99", "throughput", "preemptions"]))
    if args.engine_check:
        checks = []
        for policy in POLICIES:
            setting = Setting(policy, "poisson", **base)
            checks.append(engine_check(args, workload, cost, setting, args.engine_check))
        keys = [k for k in checks[0] if k.endswith(("_model", "_engine"))]
        text.append(f"Cost model against the real engine ({args.engine_check} requests, Poisson)\n\n"
                    + markdown(checks, ["policy", *keys]))
    for block in text:
        print(block + "\n")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "policies.md").write_text("\n\n".join(text) + "\n")
    (args.out_dir / "policies.json").write_text(json.dumps(rows, indent=1))
    traffic = requests_for(workload, args.rate, "bursty", args.seed)
    queues = {p: replay(Setting(p, "bursty", **base).engine_config(args.block_size),
                        1 + base["kv_tokens"] // args.block_size, traffic, cost) for p in POLICIES}
    plot(rows, queues, args.out_dir / "policies.png")
    print(f"wrote {args.out_dir / 'policies.md'}, policies.json, policies.png")


if __name__ == "__main__":
    main()
