"""What a block size costs, against contiguous reservations, on real workloads: KV memory reserved versus
holding tokens, sequences that fit a KV budget, preemptions, prefix-cache hits, and tokens/s.

    python scripts/make_workload.py --out out/longtail.json
    python scripts/compare_block_sizes.py --workload ../shared/workloads/w1.json --workload out/longtail.json \\
        --measure-requests 8 --out-dir docs/figures

Every request arrives at once (offline) and generates exactly its max_new_tokens. Three instruments:
- simulate.py (pure JAX, first-come first-served, one decode token a step) for each allocation: paged
  blocks on demand at each block size; a contiguous reservation of prompt + max_tokens (TGI); a
  contiguous reservation of the context length (static allocation, before PagedAttention);
- the engine's real Scheduler and BlockManager (replay.py), paged only: preemptions and prefix-cache
  hits under chunked prefill and prefix caching, as the engine runs;
- with --measure-requests N, the real engine on SmolLM2 on the first N requests of the first workload
  (output capped at --measure-tokens): tokens/s, compiles excluded. A small subset: the machine is a
  shared CPU.
"""

import argparse
import functools
import json
import pathlib
import time

import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from models import DEFAULT_MODEL
from paged_jax.research import simulate
from paged_jax.core.config import EngineConfig
from paged_jax.research.page_table import blocks_for_tokens
from paged_jax.research.replay import Request, StepCost, replay

BLOCK_SIZES = (8, 16, 32, 64, 128)
# Steps, not seconds: the replay here counts scheduling outcomes, not time.
UNIT_STEP = StepCost(a=1.0, b=0.0, c=0.0)


def allocations(block_sizes, max_model_len: int) -> list[tuple[str, int, str]]:
    """(name, block size, reservation) for each allocation policy compared."""
    return ([(f"paged, block {bs}", bs, "on demand") for bs in block_sizes]
            + [("contiguous, prompt + max_tokens (TGI)", 1, "request"),
               (f"contiguous, max_model_len {max_model_len} (static)", 1, "context")])


def simulate_allocation(prompts: np.ndarray, outputs: np.ndarray, block_size: int, reservation: str, *,
                        kv_tokens: int, max_model_len: int, max_running: int) -> dict:
    """prompts, outputs: int [requests]. Figures of one allocation policy over one workload."""
    reserve = {"on demand": np.zeros_like(prompts), "request": prompts + outputs,
               "context": np.full_like(prompts, max_model_len)}[reservation]
    arrays = (prompts, outputs, np.zeros_like(prompts), reserve)
    workload = simulate.Workload(*(jnp.asarray(a, jnp.int32) for a in arrays))
    # Enough steps for the slowest policy: list scheduling on the fewest sequences that fit ends within
    # (all output / that count + the longest output); twice that leaves room for what preemption
    # recomputes. Checked below.
    fewest = max(1, kv_tokens // max_model_len)
    num_steps = 2 * int(outputs.sum() // fewest + outputs.max())
    result = simulate.simulate(workload, num_blocks=1 + kv_tokens // block_size, block_size=block_size,
                               max_blocks_per_seq=int(blocks_for_tokens(max_model_len, block_size)),
                               num_steps=num_steps, max_running=max_running)
    finish = np.asarray(result.finish_step)
    if (finish < 0).any():
        raise RuntimeError(f"{(finish < 0).sum()} requests unfinished after {num_steps} steps")
    if int(result.pool.num_free) != kv_tokens // block_size:
        raise RuntimeError("blocks leaked in the simulation")
    running = np.asarray(result.num_running)[: finish.max() + 1]
    return dict(used=1.0 - float(simulate.waste(result, block_size)), peak_seqs=int(running.max()),
                mean_seqs=float(running.mean()), sim_preemptions=int(simulate.oom_events(result)),
                steps=int(finish.max()) + 1)


def replay_paged(requests: list[Request], block_size: int, kv_tokens: int, max_running: int) -> dict:
    """The real Scheduler and BlockManager at one block size: preemptions and prefix-cache hits."""
    config = EngineConfig(block_size=block_size, max_num_seqs=max_running, max_num_batched_tokens=2048)
    result = replay(config, 1 + kv_tokens // block_size, requests, UNIT_STEP)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return dict(preemptions=result.num_preemptions, prefix_hit=result.prefix_hit_tokens / prompt_tokens,
                engine_steps=len(result.step_time))


def measure_tokens_per_s(model, requests: list[dict], block_size: int, max_tokens: int) -> float:
    """Output tokens/s of the real engine on requests, the second of two identical runs (no compiles)."""
    from paged_jax import LLM, LLMEngine, SamplingParams

    engine = LLMEngine(model.model, model.config, model.tokenizer, EngineConfig(block_size=block_size))
    llm = LLM.from_engine(engine)
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(max_tokens, r["max_new_tokens"]))
              for r in requests]
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def compare(workload: dict, *, block_sizes, kv_tokens: int, max_model_len: int, max_running: int) -> list[dict]:
    """One row per allocation policy."""
    prompts = np.array([len(r["prompt_token_ids"]) for r in workload["requests"]])
    outputs = np.array([r["max_new_tokens"] for r in workload["requests"]])
    if (prompts + outputs).max() > max_model_len:
        raise ValueError(f"a request of {(prompts + outputs).max()} tokens exceeds max_model_len {max_model_len}")
    requests = [Request(tuple(r["prompt_token_ids"]), r["max_new_tokens"]) for r in workload["requests"]]
    rows = []
    for name, block_size, reservation in allocations(block_sizes, max_model_len):
        row = dict(allocation=name, block_size=block_size)
        row |= simulate_allocation(prompts, outputs, block_size, reservation, kv_tokens=kv_tokens,
                                   max_model_len=max_model_len, max_running=max_running)
        if reservation == "on demand":
            row |= replay_paged(requests, block_size, kv_tokens, max_running)
        rows.append(row)
    return rows


COLUMNS = [("allocation", "allocation", "{}"), ("used", "KV reserved holding tokens", "{:.1%}"),
           ("peak_seqs", "most sequences at once", "{}"), ("mean_seqs", "mean sequences", "{:.1f}"),
           ("steps", "steps to drain (sim)", "{}"), ("sim_preemptions", "preemptions (sim)", "{}"),
           ("preemptions", "preemptions (Scheduler)", "{}"),
           ("prefix_hit", "prompt tokens from prefix cache", "{:.1%}"),
           ("tokens_per_s", "measured tokens/s", "{:.1f}")]


def markdown(rows: list[dict]) -> str:
    columns = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(c[1] for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(c[2].format(r[c[0]]) if c[0] in r else "–" for c in columns) + " |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: pathlib.Path) -> None:
    fig = Figure(figsize=(10, 3.2 * len(results)), layout="constrained")
    axes = fig.subplots(len(results), 2, squeeze=False)
    for (name, rows), (left, right) in zip(results.items(), axes):
        short = {"paged, block ": "paged ", "contiguous, prompt + max_tokens (TGI)": "TGI",
                 "contiguous, max_model_len": "static", " (static)": ""}
        labels = [functools.reduce(lambda label, kv: label.replace(*kv), short.items(), r["allocation"])
                  for r in rows]
        y = np.arange(len(rows))
        left.barh(y, [100 * r["used"] for r in rows], color="tab:blue")
        left.set(yticks=y, yticklabels=labels, xlim=(0, 100), xlabel="KV reserved holding tokens (%)", title=name)
        left.invert_yaxis()
        right.barh(y, [r["peak_seqs"] for r in rows], color="tab:green")
        right.set(yticks=y, yticklabels=[], xlabel="most sequences at once in the KV budget", title=name)
        right.invert_yaxis()
    fig.savefig(path, dpi=80, bbox_inches="tight")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", type=pathlib.Path, required=True,
                        help="a workload file in W1's format (repeat for more)")
    parser.add_argument("--num-requests", type=int, help="first N requests of each workload only")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=BLOCK_SIZES)
    parser.add_argument("--kv-tokens", type=int, default=32768, help="KV budget, in tokens")
    parser.add_argument("--max-model-len", type=int, default=2048, help="what the static policy reserves")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--measure-requests", type=int, default=0,
                        help="run the real engine on this many requests of the first workload")
    parser.add_argument("--measure-tokens", type=int, default=32, help="output cap of each measured request")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("out"))
    args = parser.parse_args(argv)
    model = None
    if args.measure_requests:
        import models

        model = models.load_model(args.model)
    results, text = {}, []
    for path in args.workload:
        workload = json.loads(path.read_text())
        workload["requests"] = workload["requests"][: args.num_requests]
        name = workload.get("name", path.stem)
        rows = compare(workload, block_sizes=args.block_sizes, kv_tokens=args.kv_tokens,
                       max_model_len=args.max_model_len, max_running=args.max_num_seqs)
        if model is not None and path == args.workload[0]:
            subset = workload["requests"][: args.measure_requests]
            for row in rows[: len(args.block_sizes)]:
                row["tokens_per_s"] = measure_tokens_per_s(model, subset, row["block_size"], args.measure_tokens)
        results[name] = rows
        text.append(f"### {name}: {len(workload['requests'])} requests, KV budget {args.kv_tokens:,} tokens\n\n"
                    + markdown(rows))
        print(text[-1] + "\n", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "block_sizes.md").write_text("\n\n".join(text) + "\n")
    (args.out_dir / "block_sizes.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out_dir / "block_sizes.png")
    print(f"wrote {args.out_dir / 'block_sizes.md'}, block_sizes.json, block_sizes.png")


if __name__ == "__main__":
    main()
