"""Step time against the prompt tokens a step carries beside its decodes, on the real model once warmed
up (so nothing compiles): what long_prefill_token_threshold's default is read from.

    python scripts/measure_step_time.py [--decodes 4] [--prompt-tokens 16,32,64,128,256,512,960] [--json out/steps.json]

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
from paged_jax import LLMEngine, SamplingParams
from paged_jax.core import warmup
from paged_jax.core.scheduler import ScheduledSeq
from paged_jax.core.sequence import Sequence


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--decodes", type=int, default=4, help="sequences decoding in every step")
    p.add_argument("--context", type=int, default=300, help="tokens each decoding sequence holds")
    p.add_argument("--prompt-tokens", default="16,32,64,128,256,512,960", help="prompt chunk sizes to time")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", help="write the results to this path")
    return p.parse_args(argv)


def sequence(engine: LLMEngine, seq_id: int, num_tokens: int) -> Sequence:
    """A sequence of num_tokens prompt tokens holding blocks for all of them (none computed yet)."""
    seq = Sequence(seq_id=seq_id, request_id=str(seq_id), token_ids=[(7 * seq_id + t) % 30000 + 2 for t in range(num_tokens)],
                   num_prompt_tokens=num_tokens, params=SamplingParams(temperature=0.0), seed=seq_id, arrival_time=0.0)
    seq.block_ids = engine.blocks.allocate(-(-num_tokens // engine.resolved.block_size))
    return seq


def timed(engine: LLMEngine, scheduled: list[ScheduledSeq], repeats: int) -> float:
    """Median seconds of the step, host arrays built each time as the engine builds them."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.runner.execute(scheduled, [])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    args = parse_args(argv)
    engine = LLMEngine.from_pretrained(args.model)
    done = warmup.warm_up(engine)
    print(f"warm-up: {done.num_step_shapes} step shapes, {done.num_sampler_shapes} sampler shapes, "
          f"{done.num_programs} programs compiled or loaded, {done.seconds:.1f} s")
    budget = engine.config.max_num_batched_tokens
    decodes = [sequence(engine, i, args.context + 1) for i in range(args.decodes)]
    for seq in decodes:  # write their context's KV, a budget's worth a step
        while seq.num_computed_tokens < args.context:
            n = min(budget, args.context - seq.num_computed_tokens)
            engine.runner.execute([ScheduledSeq(seq, n)], [])
            seq.num_computed_tokens += n
    decode_step = [ScheduledSeq(seq, 1) for seq in decodes]
    decode_s = timed(engine, decode_step, args.repeats)
    rows = []
    print(f"decode-only step, {args.decodes} sequences: {1000 * decode_s:.1f} ms")
    print(f"{'prompt tokens':>14} {'step ms':>9} {'x decode step':>14}")
    for i, tokens in enumerate(int(t) for t in args.prompt_tokens.split(",")):
        prompt = sequence(engine, args.decodes + i, tokens)
        step_s = timed(engine, [*decode_step, ScheduledSeq(prompt, min(tokens, budget - args.decodes))], args.repeats)
        engine.blocks.free(prompt.block_ids)
        rows.append({"prompt_tokens": tokens, "step_ms": round(1000 * step_s, 2), "ratio": round(step_s / decode_s, 2)})
        print(f"{tokens:>14} {1000 * step_s:>9.1f} {step_s / decode_s:>14.2f}")
    result = {"model": args.model, "decodes": args.decodes, "context": args.context,
              "decode_step_ms": round(1000 * decode_s, 2), "steps": rows,
              "warm_up": {"step_shapes": done.num_step_shapes, "sampler_shapes": done.num_sampler_shapes,
                          "programs": done.num_programs, "seconds": round(done.seconds, 1)}}
    bench_throughput.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
