"""Step time against the prompt tokens a step carries beside its decodes, on the real model once warmed
up (so nothing compiles): what long_prefill_token_threshold's default is read from.

    python scripts/measure_step_time.py [--decodes 4] [--prompt-tokens 16,32,64,128,256,512,960] [--json out/steps.json]
    python scripts/measure_step_time.py --compare-helpers

With --compare-helpers, every step is also timed with the CPU kernels sharing all their work over
XLA's thread pool, as they did before they had helper threads of their own for calls of few rows
(kernels_pallas/cpu/common.h), the two alternating, and decode-only steps of 1 to 32 sequences are
added: where the helpers pay, and where they do not.

It also reports the warm-up itself (shapes, programs, seconds): run it once with an empty compilation
cache (JAX_COMPILATION_CACHE_DIR=an empty folder) for a cold start, then again for a warm one.

The decoding sequences each hold --context tokens of written KV; a step is timed --repeats times and
the median kept. Each row: a decode-only step of --decodes sequences, then the same decodes beside a
prompt chunk of P tokens, and the ratio of the two.
"""

import argparse
import statistics
import time

import bench_throughput
from kernels_pallas.cpu import kernel as cpu_kernel
from paged_jax import LLMEngine, SamplingParams
from paged_jax.core import host_memory, warmup
from paged_jax.core.scheduler import ScheduledSeq
from paged_jax.core.sequence import Sequence


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--decodes", type=int, default=4, help="sequences decoding in every step")
    p.add_argument("--context", type=int, default=300, help="tokens each decoding sequence holds")
    p.add_argument("--prompt-tokens", default="16,32,64,128,256,512,960", help="prompt chunk sizes to time")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--compare-helpers", action="store_true",
                   help="also time each step with the CPU kernels' work on XLA's pool alone, alternating")
    p.add_argument("--json", help="write the results to this path")
    return p.parse_args(argv)


def sequence(engine: LLMEngine, seq_id: int, num_tokens: int) -> Sequence:
    """A sequence of num_tokens prompt tokens holding blocks for all of them (none computed yet)."""
    seq = Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=[(7 * seq_id + t) % 30000 + 2 for t in range(num_tokens)],
                   num_prompt_tokens=num_tokens, params=SamplingParams(temperature=0.0), seed=seq_id, arrival_time=0.0)
    seq.block_ids = engine.blocks.allocate(-(-num_tokens // engine.resolved.block_size))
    return seq


def timed(engine: LLMEngine, scheduled: list[ScheduledSeq], repeats: int, helpers=(True,)) -> list[float]:
    """Median seconds of the step for each setting of the CPU kernels' helper threads (on: their
    default), alternating; host arrays built each time as the engine builds them."""
    times = {on: [] for on in helpers}
    for _ in range(repeats):
        for on in helpers:
            cpu_kernel.use_helpers(on)
            start = time.perf_counter()
            engine.runner.execute(scheduled, [])
            times[on].append(time.perf_counter() - start)
    cpu_kernel.use_helpers(True)
    return [statistics.median(times[on]) for on in helpers]


def decoding(engine: LLMEngine, first_id: int, count: int, context: int) -> list[Sequence]:
    """count sequences of context + 1 tokens, the KV of their first context tokens written."""
    seqs = [sequence(engine, first_id + i, context + 1) for i in range(count)]
    budget = engine.config.max_num_batched_tokens
    for seq in seqs:  # a budget's worth a step
        while seq.num_computed_tokens < context:
            n = min(budget, context - seq.num_computed_tokens)
            engine.runner.execute([ScheduledSeq(seq, n)], [])
            seq.num_computed_tokens += n
    return seqs


def compare_helpers(engine: LLMEngine, first_id: int, context: int, repeats: int) -> list[dict]:
    """Decode-only steps of 1 to 32 sequences, with the helpers and with XLA's pool alone."""
    rows = []
    print(f"{'decoding':>9} {'helpers ms':>11} {'pool ms':>8} {'pool / helpers':>15}")
    for count in (1, 2, 4, 8, 16, 24, 32):
        seqs = decoding(engine, first_id, count, context)
        first_id += count
        on, off = timed(engine, [ScheduledSeq(seq, 1) for seq in seqs], repeats, helpers=(True, False))
        for seq in seqs:
            engine.blocks.free(seq.block_ids)
        rows.append({"decoding": count, "helpers_ms": round(1000 * on, 2), "pool_ms": round(1000 * off, 2)})
        print(f"{count:>9} {1000 * on:>11.1f} {1000 * off:>8.1f} {off / on:>15.2f}")
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    engine = LLMEngine.from_pretrained(args.model)
    done = warmup.warm_up(engine)
    print(f"warm-up: {done.num_step_shapes} step shapes, {done.num_sampler_shapes} sampler shapes, "
          f"{done.num_programs} programs compiled or loaded, {done.seconds:.1f} s")
    budget = engine.config.max_num_batched_tokens
    helpers = (True, False) if args.compare_helpers else (True,)
    decode_step = [ScheduledSeq(seq, 1) for seq in decoding(engine, 0, args.decodes, args.context)]
    decode_s = timed(engine, decode_step, args.repeats)[0]
    rows = []
    print(f"decode-only step, {args.decodes} sequences: {1000 * decode_s:.1f} ms")
    print(f"{'prompt tokens':>14} {'step ms':>9} {'x decode step':>14}" + (f" {'pool ms':>8}" if args.compare_helpers else ""))
    for i, tokens in enumerate(int(t) for t in args.prompt_tokens.split(",")):
        prompt = sequence(engine, args.decodes + i, tokens)
        step_s, *pool_s = timed(engine, [*decode_step, ScheduledSeq(prompt, min(tokens, budget - args.decodes))],
                                args.repeats, helpers)
        engine.blocks.free(prompt.block_ids)
        rows.append({"prompt_tokens": tokens, "step_ms": round(1000 * step_s, 2), "ratio": round(step_s / decode_s, 2)}
                    | ({"pool_ms": round(1000 * pool_s[0], 2)} if pool_s else {}))
        print(f"{tokens:>14} {1000 * step_s:>9.1f} {step_s / decode_s:>14.2f}" + "".join(f" {1000 * t:>8.1f}" for t in pool_s))
    compared = compare_helpers(engine, 1000, args.context, args.repeats) if args.compare_helpers else None
    result = {"model": args.model, "decodes": args.decodes, "context": args.context,
              "decode_step_ms": round(1000 * decode_s, 2), "steps": rows, "helpers_against_pool": compared,
              "warm_up": {"step_shapes": done.num_step_shapes, "sampler_shapes": done.num_sampler_shapes,
                          "programs": done.num_programs, "seconds": round(done.seconds, 1)}}
    bench_throughput.write_json(args.json, result)
    return result


if __name__ == "__main__":
    host_memory.restart_with_tunables()
    main()
