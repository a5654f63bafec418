"""What structured outputs cost: W1 with a fifth of its requests constrained by a JSON schema against W1
unconstrained, on one engine.

    python scripts/bench_structured.py [--num-requests N] [--constrained-every 5] [--json out/structured.json]

Prints output tokens/s of both runs side by side (after a warm-up run of each), the host time a
constrained row adds to a step (its bitmask and its matcher's advance), and the longest engine step
while a new, large schema compiles on the compiler's thread (3,000 properties: about a quarter
second), beside the median decode step before it.

The constraint is an array of at least 400 integers, so a constrained request, like an unconstrained
one (EOS ignored), runs to its max_new_tokens: both runs generate the same number of tokens.
"""

import argparse
import json
import statistics
import time

from bench_throughput import add_engine_args, make_engine, run_once, workload_requests, write_json
from paged_jax import LLMEngine, SamplingParams, StructuredOutputsParams
from paged_jax.core import structured_output

LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 400}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--constrained-every", type=int, default=5, help="every k-th request is constrained")
    p.add_argument("--compile-properties", type=int, default=3000,
                   help="properties of the schema compiled while the engine runs")
    p.add_argument("--json", help="write the figures to this path")
    return p.parse_args(argv)


def constrained(params: list[SamplingParams], every: int) -> list[SamplingParams]:
    so = StructuredOutputsParams(json=LONG_ARRAY)
    return [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, structured_outputs=so) if i % every == 0 else p
            for i, p in enumerate(params)]


class HostTimer:
    """Wall time spent in the constrained rows' host work, bitmasks (allowed_tokens, which the model
    runner calls through the module) and matcher advances (Guide.accept), and the constrained rows served."""

    def __init__(self):
        self.seconds, self.rows = 0.0, 0
        self._mask, self._accept = structured_output.allowed_tokens, structured_output.Guide.accept

    def __enter__(self):
        def mask(guides, rows, vocab_size):
            start = time.perf_counter()
            try:
                return self._mask(guides, rows, vocab_size)
            finally:
                self.seconds += time.perf_counter() - start
                self.rows += sum(g is not None for g in guides)

        def accept(guide, token):
            start = time.perf_counter()
            try:
                return self._accept(guide, token)
            finally:
                self.seconds += time.perf_counter() - start

        structured_output.allowed_tokens = mask
        structured_output.Guide.accept = accept
        return self

    def __exit__(self, *exc):
        structured_output.allowed_tokens = self._mask
        structured_output.Guide.accept = self._accept


def big_schema(properties: int, salt: int) -> dict:
    """A schema unlike any compiled before (salt), with many properties of several kinds."""
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer", "minimum": -1000, "maximum": 1000},
             {"enum": [f"v{salt}_{k}" for k in range(20)]}, {"type": "array", "items": {"type": "number"}}]
    props = {f"field_{salt}_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[: properties // 2]}


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def steps_while_compiling(engine: LLMEngine, requests, params, properties: int) -> dict:
    """Decode the requests (prompts cut to 16 tokens, so that every step after the first is a decode
    step of about the same time); once decoding, submit a new schema and time every step until it has
    compiled, beside the decode steps before it. Returns the compile's own time (to its future's
    completion), the longest step while it ran and the median decode step before it."""
    for i, r in enumerate(requests):
        engine.add_request(r["prompt_token_ids"][:16], params[i])
    before = [timed_step(engine) for _ in range(8)][2:]  # the prompts' step and the first decode left out
    compiled_at = []
    submitted = time.perf_counter()
    future = engine.gate.compiler.submit(StructuredOutputsParams(json=big_schema(properties, int(submitted * 1e6))))
    future.add_done_callback(lambda _: compiled_at.append(time.perf_counter()))
    during = []
    while not future.done() or not during:
        during.append(timed_step(engine))
    future.result()
    while engine.has_unfinished_requests():
        engine.step()
    return {"compile_s": round(compiled_at[0] - submitted, 3), "steps_during_compile": len(during),
            "longest_step_ms": round(max(during) * 1e3, 2),
            "median_decode_step_ms_before": round(statistics.median(before) * 1e3, 2)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    workload, requests, plain = workload_requests(args)
    mixed = constrained(plain, args.constrained_every)
    engine = make_engine(args)
    figures = {"workload": workload.get("name", args.workload), "requests": len(requests),
               "constrained_requests": sum(p.structured_outputs is not None for p in mixed)}
    for name, params in (("unconstrained", plain), ("constrained", mixed)):
        run_once(engine, requests, params)  # warm-up: compiles, and the schema's grammar
        engine.blocks.reset_prefix_cache()
        with HostTimer() as timer:
            elapsed, produced = run_once(engine, requests, params)
        engine.blocks.reset_prefix_cache()
        figures[name] = {"wall_s": round(elapsed, 2), "output_tokens": produced,
                         "output_tokens_per_s": round(produced / elapsed, 1)}
        if timer.rows:
            figures[name]["host_us_per_constrained_row_step"] = round(timer.seconds / timer.rows * 1e6, 1)
    figures["throughput_ratio"] = round(figures["constrained"]["output_tokens_per_s"]
                                        / figures["unconstrained"]["output_tokens_per_s"], 3)
    figures["while_compiling"] = steps_while_compiling(engine, requests, plain, args.compile_properties)
    print(json.dumps(figures, indent=2))
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
