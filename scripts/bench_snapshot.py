"""What the dashboard's pool snapshot costs the engine loop, against the loop's step time.

    python scripts/bench_snapshot.py --num-requests 32 --max-tokens 128 --json out/snapshot.json

Runs the first requests of a workload (default ../shared/workloads/w1.json) through LLMEngine and, after
every step, takes paged_jax/core/snapshot.py's pool_snapshot: what the engine loop does for an open
dashboard, at most every 0.5 s (serving/dashboard.py). Apart from it, it times block_states, which the
server computes from the snapshot off the loop. Medians, so that the steps that compile weigh nothing.
Reports a snapshot against one step (the bound, were one taken every step) and the share of the loop's
time that one every 0.5 s takes.
"""

import argparse
import dataclasses
import pathlib
import sys
import time

import numpy as np

from paged_jax.core.snapshot import block_states, pool_snapshot
from paged_jax.serving.dashboard import SNAPSHOT_INTERVAL_S

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_throughput  # noqa: E402

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_throughput.add_engine_args(p)
    p.add_argument("--max-tokens", type=int, help="cap each request's output (default: the workload's)")
    p.add_argument("--json", help="write the figures to this path")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    engine = bench_throughput.make_engine(args)
    _, requests, params = bench_throughput.workload_requests(args)
    if args.max_tokens:
        params = [dataclasses.replace(p, max_tokens=min(p.max_tokens, args.max_tokens)) for p in params]
    step_s, snapshot_s, states_s, sizes = [], [], [], []

    def step():
        start = time.perf_counter()
        engine.step()
        stepped = time.perf_counter()
        snap = pool_snapshot(engine)
        snapped = time.perf_counter()
        block_states(snap)
        step_s.append(stepped - start)
        snapshot_s.append(snapped - stepped)
        states_s.append(time.perf_counter() - snapped)
        sizes.append(len(snap["seqs"]))

    for request, p in zip(requests, params):
        engine.add_request(request["prompt_token_ids"], p)
    while engine.has_unfinished_requests():
        step()
    step_ms, snapshot_ms = 1000 * float(np.median(step_s)), 1000 * float(np.median(snapshot_s))
    figures = {
        "model": args.model, "num_blocks": engine.blocks.num_blocks, "steps": len(step_s),
        "max_sequences_in_a_snapshot": max(sizes), "step_ms_median": round(step_ms, 3),
        "snapshot_ms_median": round(snapshot_ms, 4),
        "snapshot_ms_p99": round(1000 * float(np.percentile(snapshot_s, 99)), 4),
        "block_states_ms_median": round(1000 * float(np.median(states_s)), 4),
        "snapshot_per_step_percent": round(100 * snapshot_ms / step_ms, 4),
        "loop_share_at_dashboard_rate_percent": round(100 * snapshot_ms / max(step_ms, 1000 * SNAPSHOT_INTERVAL_S), 4),
    }
    for key, value in figures.items():
        print(f"{key:<40}{value}")
    bench_throughput.write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
