"""Copy me: how block size trades internal fragmentation for out-of-memory events, over 1,000 random
workloads at once (one jax.vmap call per block size), on paged-jax's pure block pool and page tables.

    python examples/block_size_sweep.py --out block_size_sweep.png
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure

from paged_jax.research import simulate
from paged_jax.research.page_table import blocks_for_tokens


def random_workloads(key: jax.Array, num: int, requests: int) -> simulate.Workload:
    """num workloads of `requests` requests; every array int32 [num, requests]. Lengths are
    log-normal, as chat traffic's are: many short, a few long."""
    k_prompt, k_output, k_arrival = jax.random.split(key, 3)
    prompts = jnp.clip(jnp.exp(4.0 + 1.0 * jax.random.normal(k_prompt, (num, requests))), 1, 512).astype(jnp.int32)
    outputs = jnp.clip(jnp.exp(4.0 + 0.8 * jax.random.normal(k_output, (num, requests))), 1, 256).astype(jnp.int32)
    arrivals = jnp.sort(jax.random.randint(k_arrival, (num, requests), 0, 100), axis=-1)
    return simulate.Workload(prompts, outputs, arrivals, jnp.zeros((num, requests), jnp.int32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="block_size_sweep.png")
    parser.add_argument("--workloads", type=int, default=1000)
    parser.add_argument("--kv-tokens", type=int, default=2048, help="KV budget, in tokens")
    args = parser.parse_args()
    workloads = random_workloads(jax.random.key(0), args.workloads, requests=32)
    block_sizes = [8, 16, 32, 64, 128]
    waste, ooms = [], []
    for bs in block_sizes:
        run = functools.partial(simulate.simulate, num_blocks=1 + args.kv_tokens // bs, block_size=bs,
                                max_blocks_per_seq=int(blocks_for_tokens(768, bs)), num_steps=400, max_running=32)
        result = jax.vmap(run)(workloads)  # every field gains a leading axis of args.workloads
        waste.append(simulate.waste(result, bs))
        ooms.append(simulate.oom_events(result))
        print(f"block_size {bs:>3}: waste {float(waste[-1].mean()):.1%}, "
              f"out-of-memory events {float(ooms[-1].mean()):.1f} per workload")
    fig = Figure(figsize=(9, 3.5))
    left, right = fig.subplots(1, 2)
    left.boxplot([w * 100 for w in waste], tick_labels=[str(b) for b in block_sizes])
    left.set(xlabel="block size", ylabel="KV slots holding no token (%)")
    right.boxplot(ooms, tick_labels=[str(b) for b in block_sizes])
    right.set(xlabel="block size", ylabel="out-of-memory events per workload")
    fig.savefig(args.out, dpi=100, bbox_inches="tight")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
