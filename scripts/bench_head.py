"""The head of a greedy step at a wide vocabulary: the final norm, the lm_head (packed for the C++
matmul) and the sampler, `step_programs.sample_step` as the engine calls it, for Gemma 3 270M's shape
(hidden 640, 262,144 tokens, tied embeddings; random weights) at a few (live rows, bucket rows).

    python scripts/bench_head.py [--rows 16:16 41:48 64:64] [--rounds 9] [--vocab 262144] [--hidden 640]
    python scripts/bench_head.py --hidden 64 --vocab 8192 --rows 64:64 256:256   # the tiny model's head

Each case runs four ways, alternating in one process, the first three the same program on different
inputs:
- as the engine runs it: the lm_head over the live rows only (SamplingTensors.num_rows), no ban
  mask spelled out where no row bans (SamplingTensors.any_banned false), and so the fused greedy head
  (sampling.sample_head: the lm_head and argmax in one C++ call, no logits written);
- "logits": the same step's logits written by the lm_head, then their argmax (`sample` over
  `logits`, as sample_step ran before the fused greedy head);
- "+ ban": any_banned set with an empty mask, so the mask is spelled out over the vocabulary as every
  greedy step did before the sampler skipped it;
- "+ ban + padding": that, and every row of the bucket through the lm_head (num_rows = bucket rows),
  as every step did before: the whole saving.
Prints the median ms of each, the ratio of the last to the first and of "logits" to the first (the
fused greedy head's own gain); `main` returns the medians per case. Greedy tokens of the live rows
must agree across the four.
"""

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.tiny import TINY_GEMMA3, random_model
from paged_jax.core import packing, sampling
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.sampling_tensors import make_sampling_tensors
from paged_jax.core.step_programs import ModelGraph, sample_step
from paged_jax.research import machine


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["16:16", "41:48", "64:64"], help="live:bucket rows")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--vocab", type=int, default=262144, help="Gemma 3's; smaller for a quick check")
    p.add_argument("--hidden", type=int, default=640, help="Gemma 3 270M's")
    args = p.parse_args(argv)
    print(machine.one_line(machine.describe()))
    config = dataclasses.replace(TINY_GEMMA3, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=1,
                                 layer_types=("full_attention",), final_logit_softcapping=None)
    model = random_model(config).pack_for_cpu()
    graphdef, state = nnx.split(model)
    graph, weights = ModelGraph(graphdef, state), tuple(jax.tree.leaves(state))
    vocab, figures = args.vocab, {}
    logits_then_argmax = jax.jit(lambda hidden, t: (sampling.sample(model.logits(hidden, t.num_rows), t),))
    for case in args.rows:
        live, rows = map(int, case.split(":"))
        hidden = jnp.asarray(np.random.default_rng(0).standard_normal((rows, args.hidden), np.float32))
        previous = jnp.zeros(rows, jnp.int32)
        t = make_sampling_tensors([SamplingParams(temperature=0)] * live, [0] * live, [[1]] * live, [[]] * live, [1],
                                  pad_rows_to=rows, vocab_size=vocab, history_width=0)
        ways = {"engine": t, "+ ban": dataclasses.replace(t, any_banned=np.bool_(True))}
        ways["+ ban + padding"] = dataclasses.replace(ways["+ ban"], num_rows=np.int32(rows))
        calls = {}
        for name, tensors in ways.items():
            packed, layout = packing.pack(tensors)
            calls[name] = functools.partial(sample_step, graph, weights, hidden, packed, previous, layout=layout)
        calls["logits"] = functools.partial(logits_then_argmax, hidden, t)
        calls = {name: calls[name] for name in ("engine", "logits", "+ ban", "+ ban + padding")}
        tokens = [np.asarray(call()[0].tokens)[:live] for call in calls.values()]  # compiles, once
        assert all((x == tokens[0]).all() for x in tokens), "the four ways disagree"
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(call())
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * float(np.median(ts)) for name, ts in times.items()}
        print(f"{live} live of {rows} rows: " + ", ".join(f"{name} {v:.1f} ms" for name, v in ms.items())
              + f"; before / now {ms['+ ban + padding'] / ms['engine']:.2f}"
              + f", logits / fused {ms['logits'] / ms['engine']:.2f}", flush=True)
        figures[case] = ms
    return figures


if __name__ == "__main__":
    main()
