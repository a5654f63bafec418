"""The block pool's occupancy over time, replayed: a workload through the real Scheduler and BlockManager
(paged_jax/research/replay.py) with paged allocation, with and without prefix sharing, beside static
reservation (each request reserving the whole context length when admitted: simulate.py's textbook
allocation, on the same functional block pool), written as a PNG and an animated, self-contained HTML page.

    python scripts/visualize.py --out-dir out/visualize
    python scripts/visualize.py --workload ../shared/workloads/w1.json --num-blocks 1024 --out-dir out/w1

All requests arrive at once (an offline batch) and every step computes one token per running request
(the replay's token budget lets a prompt be prefilled in its admission step, as simulate.py does), so a
step means the same in the three runs. simulate.py keeps counts, not block identities: the static
run's cells are its counts laid out in order, blocks holding tokens first, then reserved but empty.
"""

import argparse
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from paged_jax.core.config import EngineConfig
from paged_jax.core.snapshot import CACHED, FREE, HELD, RESERVED, SHARED, block_states, num_used_blocks
from paged_jax.research import simulate
from paged_jax.research.page_table import blocks_for_tokens
from paged_jax.research.replay import Request, StepCost, replay

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from make_workload import make_workload  # noqa: E402

TEMPLATE = pathlib.Path(__file__).with_name("visualize.html")
COST = StepCost(a=0.01, b=1e-4, c=0.0)  # the figures count steps: any clock does
# One character per cell in the page's frames, by block state; FILLED and EMPTY are the static run's
# reserved blocks.
_CODE = {FREE: ".", HELD: "h", SHARED: "s", CACHED: "c", RESERVED: "x"}
CODES = np.array([_CODE[state] for state in range(len(_CODE))])
FILLED, EMPTY = "f", "e"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", help="a workload in W1's format (default: scripts/make_workload.py's, seeded, "
                                      "a share of its prompts opening with one of a few system prompts)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="for the default workload")
    p.add_argument("--num-blocks", type=int, default=320, help="the pool, its null block included")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024, help="what static reservation reserves per request")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-frames", type=int, default=200, help="steps shown by the animation, evenly spaced")
    p.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("out/visualize"))
    return p.parse_args(argv)


def load_requests(args: argparse.Namespace) -> list[Request]:
    if args.workload:
        workload = json.loads(pathlib.Path(args.workload).read_text())
    else:
        workload = make_workload(args.num_requests, args.seed, prompt_median=60, output_median=80,
                                 max_len=args.max_model_len)
    return [Request(tuple(r["prompt_token_ids"]), r["max_new_tokens"])
            for r in workload["requests"][: args.num_requests]]


def paged_run(requests: list[Request], args: argparse.Namespace, prefix_sharing: bool) -> tuple[list[dict], object]:
    """(one frame per step: the pool's cells and owners, blocks in use, token slots and tokens of the
    running sequences, their number; the replay's own result)."""
    config = EngineConfig(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_model_len * args.max_num_seqs,
                          enable_prefix_caching=prefix_sharing)
    frames = []

    def observe(clock: float, snap: dict) -> None:
        state, _, owner = block_states(snap)
        running = [s for s in snap["seqs"] if s["status"] == "running"]
        frames.append(dict(cells="".join(CODES[state]), owner=owner.tolist(), used=num_used_blocks(state),
                           slots=sum(len(s["block_ids"]) for s in running) * args.block_size,
                           tokens=sum(s["num_computed_tokens"] for s in running), running=len(running)))

    return frames, replay(config, args.num_blocks, requests, COST, observe=observe)


def static_run(requests: list[Request], args: argparse.Namespace) -> list[dict]:
    """One frame per step of simulate.py with every request reserving max_model_len at admission."""
    reserve = blocks_for_tokens(args.max_model_len, args.block_size)
    if reserve > args.num_blocks - 1:
        raise SystemExit(f"visualize.py: a pool of {args.num_blocks} blocks cannot reserve {args.max_model_len} tokens")
    prompts = jnp.array([len(r.prompt_token_ids) for r in requests], jnp.int32)
    outputs = jnp.array([r.max_tokens for r in requests], jnp.int32)
    workload = simulate.Workload(prompt_lens=prompts, output_lens=outputs, arrival_steps=jnp.zeros_like(prompts),
                                 reserve_tokens=jnp.full_like(prompts, args.max_model_len))
    # Enough steps even were the requests run one at a time.
    result = simulate.simulate(workload, num_blocks=args.num_blocks, block_size=args.block_size,
                               max_blocks_per_seq=reserve, num_steps=int(outputs.sum()) + len(requests),
                               max_running=args.max_num_seqs)
    end = int(jnp.max(result.finish_step)) + 1
    frames = []
    for used, tokens, running in zip(*(np.asarray(a[:end]).tolist() for a in
                                       (result.blocks_in_use, result.tokens_held, result.num_running))):
        filled = min(used, -(-tokens // args.block_size))
        cells = "x" + FILLED * filled + EMPTY * (used - filled) + "." * (args.num_blocks - 1 - used)
        frames.append(dict(cells=cells, used=used, slots=used * args.block_size, tokens=tokens, running=running))
    return frames


def plot(runs: dict[str, list[dict]], args: argparse.Namespace, path: pathlib.Path) -> None:
    fig = Figure(figsize=(10, 7), layout="constrained")
    occupancy, running = fig.subplots(2, 1, sharex=True)
    for (name, frames), colour in zip(runs.items(), ("tab:orange", "tab:blue", "tab:green")):
        occupancy.plot([f["used"] for f in frames], color=colour, label=f"{name}: blocks in use")
        occupancy.plot([f["tokens"] / args.block_size for f in frames], color=colour, linestyle=":",
                       label=f"{name}: tokens its requests hold, in blocks")
        running.plot([f["running"] for f in frames], color=colour, label=f"{name} (done at step {len(frames)})")
    occupancy.axhline(args.num_blocks - 1, color="black", linewidth=0.8, linestyle="--", label="pool")
    occupancy.set_ylabel(f"KV blocks ({args.block_size} tokens)")
    occupancy.legend(fontsize=8, ncol=2, loc="center right")
    occupancy.set_title("Block pool occupancy over a replayed batch: static reservation against paged allocation")
    running.set_ylabel("requests running")
    running.set_xlabel("step")
    running.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def animation_data(runs: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The page's data: the same evenly spaced steps of every run (a finished run shows its last)."""
    longest = max(len(frames) for frames in runs.values())
    steps = np.unique(np.linspace(0, longest - 1, min(args.max_frames, longest)).astype(int)).tolist()
    return dict(block_size=args.block_size, num_blocks=args.num_blocks, steps=steps, scenarios=[
        dict(name=name, done=len(frames), frames=[frames[min(i, len(frames) - 1)] for i in steps])
        for name, frames in runs.items()])


def main(argv=None) -> dict:
    args = parse_args(argv)
    requests = load_requests(args)
    runs = {"static reservation": static_run(requests, args),
            "paged": paged_run(requests, args, prefix_sharing=False)[0],
            "paged + prefix sharing": paged_run(requests, args, prefix_sharing=True)[0]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(runs, args, args.out_dir / "occupancy.png")
    data = animation_data(runs, args)
    page = TEMPLATE.read_text().replace("/*DATA*/null", json.dumps(data, separators=(",", ":")))
    (args.out_dir / "occupancy.html").write_text(page)
    summary = {name: dict(steps=len(frames), peak_blocks=max(f["used"] for f in frames),
                          mean_running=round(float(np.mean([f["running"] for f in frames])), 2),
                          slot_waste=round(1 - sum(f["tokens"] for f in frames) / sum(f["slots"] for f in frames), 3))
               for name, frames in runs.items()}
    for name, s in summary.items():
        print(f"{name:<24} {s['steps']:>6} steps  peak {s['peak_blocks']:>5} blocks  "
              f"{s['mean_running']:>6} running on average  {100 * s['slot_waste']:.1f}% of slots empty")
    print(f"wrote {args.out_dir / 'occupancy.png'} and {args.out_dir / 'occupancy.html'}")
    return summary


if __name__ == "__main__":
    main()
