"""Token-major against head-major KV pages: attention time per step and W1 throughput, side by side.

    python scripts/compare_layouts.py --num-requests 16 --markdown docs/layouts_table.md \
        --png docs/figures/layouts.png

Attention: one layer at SmolLM2-135M's shapes (9 heads over 3 KV heads, head_dim 64, float32) on two
engine-shaped steps (scripts/bench_attention_cpu.py makes them: bucketed widths, pages in random
order): a decode step of 64 sequences with 600 tokens of context, and a prefill chunk of 512 new
tokens after a cached prefix of 512. For each block size and backend both layouts attend over the
same tokens (the head-major pages are the token-major ones transposed), called in alternating turns
so that the machine's noise hits both alike; min and median milliseconds of the calls.

Backends: "cpu" (the C++ kernel) and "xla" on a CPU. The Pallas kernel runs here only in the Pallas
interpreter, seconds a call, which checks it but times nothing; on a GPU pass --backends pallas.

W1: the whole engine (SmolLM2-135M) on W1, or its first --num-requests requests (the machine is
shared; the output says which), one engine per layout, one warm-up run each, then timed runs in
alternating turns; min and median output tokens/s.
"""

import argparse
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np

import bench_attention_cpu
import bench_throughput
import kernels_pallas
import models
from kernels_pallas import layout
from kernels_pallas.metadata import AttentionMetadata
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.research import machine

STEPS = {
    "decode step (64 x 600)": bench_attention_cpu.Scenario("decode", (599,) * 64, (1,) * 64),
    "prefill chunk (512 after 512)": bench_attention_cpu.Scenario("prefill", (512,), (512,)),
}
SHAPES = dict(num_heads=9, num_kv_heads=3, head_dim=64, dtype="float32")  # SmolLM2-135M, one layer


def attention(backend: str, kv_layout: str, max_query_len: int):
    """The model's attention call (the seam), jitted for one backend and layout."""

    def call(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc):
        metadata = AttentionMetadata(slot_mapping=jnp.full(q.shape[:1], -1, jnp.int32),  # attention never reads it
                                     block_tables=block_tables, seq_lens=seq_lens,
                                     query_start_loc=query_start_loc, max_query_len=max_query_len)
        return kernels_pallas.paged_attention(q, k_pages, v_pages, metadata, backend=backend, layout=kv_layout)

    return jax.jit(call)


def time_attention(block_sizes, backends, rounds) -> list[dict]:
    """Rows of (step, block_size, backend, layout, min_ms, median_ms)."""
    rng = np.random.default_rng(0)
    rows = []
    for block_size in block_sizes:
        for step, scenario in STEPS.items():
            inputs, max_query_len = bench_attention_cpu.make_step(
                scenario, types.SimpleNamespace(block_size=block_size, **SHAPES), rng)
            pages = {kv_layout: tuple(layout.convert(p, layout.TOKEN_MAJOR, kv_layout) for p in inputs[1:3])
                     for kv_layout in layout.LAYOUTS}
            # Every (backend, layout) call on its own pages; the timing turns interleave them all.
            fns = {(backend, kv_layout): (lambda f=attention(backend, kv_layout, max_query_len), kv=pages[kv_layout]:
                                          f(inputs[0], *kv, *inputs[3:]))
                   for backend in backends for kv_layout in layout.LAYOUTS}
            outputs = [np.asarray(f()) for f in fns.values()]
            assert all(np.allclose(o, outputs[0], rtol=1e-4, atol=1e-5) for o in outputs), "layouts disagree"
            for (backend, kv_layout), ms in bench_attention_cpu.timings_ms(fns, (), rounds).items():
                rows.append(dict(step=step, block_size=block_size, backend=backend, layout=kv_layout,
                                 min_ms=float(ms.min()), median_ms=float(np.median(ms))))
                print(f"{step:>30} bs {block_size:>2} {backend:>4} {kv_layout:>11}: min {ms.min():7.2f} ms, "
                      f"median {np.median(ms):7.2f} ms", flush=True)
    return rows


def time_w1(args) -> list[dict]:
    """Rows of (layout, requests, min and median output tokens/s) over --repeats alternating runs."""
    workload = bench_throughput.load_workload(args.workload)
    requests = workload["requests"][: args.num_requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True) for r in requests]
    loaded = models.load_model(args.model)
    engines = {kv_layout: LLMEngine(loaded.model, loaded.config, loaded.tokenizer,
                                    EngineConfig(block_size=args.w1_block_size, kv_layout=kv_layout))
               for kv_layout in layout.LAYOUTS}
    rates = {kv_layout: [] for kv_layout in engines}
    for turn in range(args.repeats + 1):  # turn 0 warms up (compiles), untimed
        for kv_layout, engine in engines.items():
            elapsed, produced = bench_throughput.run_once(engine, requests, params)
            if turn:
                rates[kv_layout].append(produced / elapsed)
                print(f"W1 {len(requests)} requests, {kv_layout}: {produced / elapsed:.1f} output tokens/s", flush=True)
    return [dict(layout=kv_layout, requests=len(requests), of=len(workload["requests"]),
                 min_tok_s=min(r), median_tok_s=float(np.median(r)), backend=engines[kv_layout].resolved.attention_backend)
            for kv_layout, r in rates.items()]


def markdown(attention_rows, w1_rows, rounds) -> str:
    lines = [machine.one_line(machine.describe()), "",
             f"Attention, one layer, ms (min / median of {5 * rounds} calls; head-major / token-major of the medians)",
             "", "| step | block size | backend | token-major | head-major | ratio |", "|---|---|---|---|---|---|"]
    cell = {(r["step"], r["block_size"], r["backend"], r["layout"]): r for r in attention_rows}
    for step, block_size, backend in dict.fromkeys((r["step"], r["block_size"], r["backend"]) for r in attention_rows):
        tm, hm = (cell[step, block_size, backend, kv_layout] for kv_layout in layout.LAYOUTS)
        lines.append(f"| {step} | {block_size} | {backend} | {tm['min_ms']:.2f} / {tm['median_ms']:.2f} "
                     f"| {hm['min_ms']:.2f} / {hm['median_ms']:.2f} | {hm['median_ms'] / tm['median_ms']:.2f} |")
    if w1_rows:
        subset = w1_rows[0]["requests"] < w1_rows[0]["of"]
        lines += ["", f"W1 end to end ({w1_rows[0]['requests']} of its {w1_rows[0]['of']} requests"
                  f"{', a subset: the machine is shared' if subset else ''}), output tokens/s",
                  "", "| layout | backend | min | median |", "|---|---|---|---|"]
        lines += [f"| {r['layout']} | {r['backend']} | {r['min_tok_s']:.1f} | {r['median_tok_s']:.1f} |"
                  for r in w1_rows]
    return "\n".join(lines) + "\n"


def plot(attention_rows, w1_rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(STEPS) + bool(w1_rows), figsize=(5 * (len(STEPS) + bool(w1_rows)), 4))
    for ax, step in zip(axes, STEPS):
        for backend in dict.fromkeys(r["backend"] for r in attention_rows):
            for kv_layout, style in zip(layout.LAYOUTS, ("-o", "--s")):
                rows = [r for r in attention_rows if (r["step"], r["backend"], r["layout"]) == (step, backend, kv_layout)]
                ax.plot([r["block_size"] for r in rows], [r["median_ms"] for r in rows], style,
                        label=f"{backend}, {kv_layout}")
        ax.set(title=step, xlabel="block size (tokens)", ylabel="ms per layer (median)", xscale="log")
        ax.minorticks_off()
        ax.set_xticks([r["block_size"] for r in attention_rows], [str(r["block_size"]) for r in attention_rows])
        ax.legend(fontsize=8)
    if w1_rows:
        ax = axes[-1]
        ax.bar([r["layout"] for r in w1_rows], [r["median_tok_s"] for r in w1_rows], color=["C0", "C1"])
        ax.errorbar([r["layout"] for r in w1_rows], [r["median_tok_s"] for r in w1_rows],
                    yerr=[[r["median_tok_s"] - r["min_tok_s"] for r in w1_rows], [0] * len(w1_rows)], fmt="none",
                    color="k")
        ax.set(title=f"W1, {w1_rows[0]['requests']} of {w1_rows[0]['of']} requests", ylabel="output tokens/s (median, bar to min)")
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--backends", nargs="+", default=["cpu", "xla"], choices=["cpu", "xla", "pallas"],
                   help="pallas on a GPU only (interpreted on a CPU it is too slow to time)")
    p.add_argument("--rounds", type=int, default=3, help="alternating turns of 5 calls per layout and backend")
    p.add_argument("--workload", default=str(bench_throughput.DEFAULT_WORKLOAD))
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--num-requests", type=int, help="W1's first N requests only (0: skip W1)")
    p.add_argument("--repeats", type=int, default=2, help="timed W1 runs per layout, alternating")
    p.add_argument("--w1-block-size", type=int, default=16)
    p.add_argument("--markdown", help="write the tables here")
    p.add_argument("--png", help="write the plot here")
    args = p.parse_args(argv)

    attention_rows = time_attention(args.block_sizes, args.backends, args.rounds)
    w1_rows = time_w1(args) if args.num_requests != 0 else []
    table = markdown(attention_rows, w1_rows, args.rounds)
    print(table)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(table)
    if args.png:
        plot(attention_rows, w1_rows, args.png)


if __name__ == "__main__":
    main()
