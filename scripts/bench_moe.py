"""A mixture-of-experts decode step against a dense one with the same active parameters, side by side.

    python scripts/bench_moe.py [--decodes 1,4,16] [--repeats 20] [--json out/moe.json]

Two random models of one shape (models/tiny.random_model), a Qwen3-MoE whose every layer has top 2 of 8
experts of width --expert-width, and a Qwen3 whose dense MLP is twice that width: the same attention, the
same embedding and lm_head, the same multiply-adds per token. Each runs through the engine's own step
(engine.runner.execute, as scripts/measure_step_time.py times it) with both matmul backends: "cpu", where
the experts go through the C++ matmul one expert at a time over only its own rows (models/moe.py), and
"xla", where they go through jax.lax.ragged_dot. The four engines' steps alternate, so the machine's
load (shared here) falls on all of them alike. Each row: decode-only steps of N sequences of --context
tokens, the median ms of each, and MoE / dense per backend.

It first says how ragged_dot lowers on this backend: JAX gives XLA a `ragged_dot` instruction on TPU
and GPU only; elsewhere it lowers `_ragged_dot_general_impl`, a dense dot of every row against every
expert with the rows of the other experts masked to zero.
"""

import argparse
import dataclasses
import statistics
import time

import bench_throughput
import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.tiny import random_model
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.core import host_memory
from paged_jax.core.scheduler import ScheduledSeq
from paged_jax.core.sequence import Sequence


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--expert-width", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--decodes", default="1,4,16", help="sequences decoding in a step")
    p.add_argument("--context", type=int, default=128, help="tokens each decoding sequence holds")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", help="write the results to this path")
    return p.parse_args(argv)


def configs(args) -> dict[str, ModelConfig]:
    dense = ModelConfig(
        architecture="qwen3", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.expert_width,
        num_layers=args.layers, num_heads=16, num_kv_heads=4, head_dim=args.hidden // 16, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=4096, qk_norm=True)
    moe = dataclasses.replace(dense, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=args.expert_width, norm_topk_prob=True)
    return {"moe": moe, "dense": dense}


def ragged_dot_lowering() -> str:
    """What XLA is given for a ragged_dot on the default backend, and what it compiles, in words."""
    x, w, sizes = jnp.zeros((4, 8)), jnp.zeros((3, 8, 16)), jnp.array([1, 2, 1], jnp.int32)
    lowered = jax.jit(jax.lax.ragged_dot).lower(x, w, sizes)
    if "chlo.ragged_dot" in (text := lowered.as_text()):
        return "a ragged_dot instruction (a grouped matmul)"
    compiled = lowered.compile().as_text()
    return (f"no ragged_dot instruction: {text.count('stablehlo.dot_general')} dot_general of every row against "
            f"all {w.shape[0]} experts, the other experts' rows masked by {text.count('stablehlo.select')} select; "
            + ("compiled, every expert's weights are transposed into one [experts * K, N] operand of the dot "
               "on every call" if " transpose(" in compiled else "no transpose of the weights when compiled"))


def decoding(engine: LLMEngine, count: int, context: int) -> list[ScheduledSeq]:
    """A decode step of `count` sequences, each holding the written KV of `context` tokens."""
    block = engine.resolved.block_size
    scheduled = []
    for i in range(count):
        seq = Sequence(seq_id=i, request_id=str(i), token_ids=[(7 * i + t) % 1000 + 2 for t in range(context + 1)],
                       num_prompt_tokens=context + 1, params=SamplingParams(temperature=0.0), seed=i,
                       arrival_time=0.0)
        seq.block_ids = engine.blocks.allocate(-(-(context + 1) // block))
        while seq.num_computed_tokens < context:
            n = min(engine.config.max_num_batched_tokens, context - seq.num_computed_tokens)
            engine.runner.execute([ScheduledSeq(seq, n)], [])
            seq.num_computed_tokens += n
        scheduled.append(ScheduledSeq(seq, 1))
    return scheduled


def main(argv=None) -> dict:
    args = parse_args(argv)
    lowering = ragged_dot_lowering()
    print(f"jax.lax.ragged_dot on {jax.default_backend()}: {lowering}")
    models = {name: random_model(config) for name, config in configs(args).items()}
    engines = {(name, backend): LLMEngine(models[name], models[name].config, None, EngineConfig(
        attention_backend="cpu", matmul_backend=backend, block_size=16, num_blocks=512, max_num_batched_tokens=256))
        for name in models for backend in ("cpu", "xla")}
    rows = []
    print(f"{'decoding':>9} " + " ".join(f"{n + ' ' + b + ' ms':>14}" for n, b in engines)
          + f" {'MoE/dense cpu':>14} {'MoE/dense xla':>14}")
    for count in (int(n) for n in args.decodes.split(",")):
        steps = {key: decoding(engine, count, args.context) for key, engine in engines.items()}
        times = {key: [] for key in engines}
        for _ in range(2):  # compiled and warm
            for key, engine in engines.items():
                engine.runner.execute(steps[key], [])
        for _ in range(args.repeats):
            for key, engine in engines.items():
                start = time.perf_counter()
                engine.runner.execute(steps[key], [])
                times[key].append(time.perf_counter() - start)
        for key, engine in engines.items():
            for scheduled in steps[key]:
                engine.blocks.free(scheduled.seq.block_ids)
        ms = {key: 1000 * statistics.median(t) for key, t in times.items()}
        ratio = {b: ms["moe", b] / ms["dense", b] for b in ("cpu", "xla")}
        rows.append({"decoding": count, **{f"{n}_{b}_ms": round(v, 2) for (n, b), v in ms.items()},
                     **{f"ratio_{b}": round(v, 2) for b, v in ratio.items()}})
        print(f"{count:>9} " + " ".join(f"{v:>14.2f}" for v in ms.values())
              + f" {ratio['cpu']:>14.2f} {ratio['xla']:>14.2f}")
    result = {"ragged_dot_lowering": lowering, "shape": vars(args), "steps": rows}
    bench_throughput.write_json(args.json, result)
    return result


if __name__ == "__main__":
    host_memory.restart_with_tunables()
    main()
