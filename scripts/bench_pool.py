"""The engine's scheduling host time over the jitted block pool, without a model, at two pool sizes.

    python scripts/bench_pool.py [--num-blocks 131073 2049] [--block-size 16] [--rounds 3]

Replays the workload (default W1) through the real Scheduler and BlockManager, each step's pool
operations replayed on the pool of record in one jitted call on the CPU device as in the engine
(paged_jax/research/replay.py with functional_pool=True, steps of a fixed 10 ms of simulated time), and prints the wall time per step. A GPU's pool is large
(131,073 blocks of 16 for SmolLM2 on an H200 at gpu_memory_utilization 0.9), a CPU's small: whatever
a pool operation costs per block shows as the gap between the two.
"""

import argparse
import statistics
import time

import bench_throughput
from paged_jax import EngineConfig
from paged_jax.research import machine
from paged_jax.research.replay import Request, StepCost, replay


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=str(bench_throughput.DEFAULT_WORKLOAD))
    p.add_argument("--num-blocks", type=int, nargs="+", default=[131073, 2049])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="timed replays per pool size, after one untimed")
    args = p.parse_args(argv)
    requests = [Request(tuple(r["prompt_token_ids"]), r["max_new_tokens"])
                for r in bench_throughput.load_workload(args.workload)["requests"]]
    print(machine.one_line(machine.describe()))
    figures = {}
    for num_blocks in args.num_blocks:
        walls, steps = [], 0
        for i in range(args.rounds + 1):  # the first compiles the pool's programs
            start = time.perf_counter()
            out = replay(EngineConfig(block_size=args.block_size), num_blocks, requests, StepCost(0.01, 0.0, 0.0),
                         functional_pool=True)
            walls.append(time.perf_counter() - start)
            steps = len(out.step_time)
        ms = statistics.median(walls[1:]) / steps * 1e3
        figures[num_blocks] = ms
        print(f"num_blocks {num_blocks:>7}: {steps} steps, scheduling {ms:.3f} ms a step (median of {args.rounds})")
    return figures


if __name__ == "__main__":
    main()
