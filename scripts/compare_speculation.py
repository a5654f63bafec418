"""Speculative decoding's acceptance and speed against k, method and workload: which k suits which traffic.

    python scripts/compare_speculation.py [--ks 1,2,3,5,8] [--methods ngram,suffix]
                                          [--workloads edit,rewrite,quote,w1] [--concurrency 1]
                                          [--requests 4] [--max-tokens 64] [--rounds 1] [--json out/k.json]

Workloads as bench_spec.py's (spec_workloads.py). One engine per method, built for the largest k
(its verify shapes hold every smaller one), and one without speculation; each k is that engine's
speculator told a smaller num_speculative_tokens, so no k compiles shapes of its own or pays for
another's. Every (workload, method, k) first runs once untimed (compiling what it meets); then each
round runs, per workload, no speculation and every (method, k) in turn, --requests requests kept
--concurrency at a time, greedy, EOS ignored, prefix cache and suffix decoding's outputs emptied
before each run (bench_spec.run). Greedy outputs must equal no speculation's (it fails otherwise).

Per row: acceptance rate (draft tokens accepted / draft tokens proposed), mean accepted length (tokens
accepted per verified draft; each verify step emits that plus one), the verified drafts (sequence
steps that drafted, over all rounds), output tok/s (median over rounds) and the median of each round's ratio to none.
Speculation is never turned off by batch size here (disable_by_batch_size None), nor per request
for low acceptance, so each k is measured as it is.
"""

import argparse
import dataclasses
import statistics
import sys

import bench_spec
import bench_throughput
import models
import spec_workloads
from paged_jax import EngineConfig, LLMEngine
from paged_jax.research import machine


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--ks", default="1,2,3,5,8")
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--workloads", default=",".join(spec_workloads.KINDS))
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--json")
    return p.parse_args(argv)


def measure(engine: LLMEngine, requests, concurrency: int) -> tuple[float, list, dict]:
    """(output tok/s, outputs, {"drafts", "draft_tokens", "accepted"} of this run, {} without speculation)."""
    spec = engine.speculator
    before = dataclasses.replace(spec.stats) if spec else None
    elapsed, outputs, _ = bench_spec.run(engine, requests, concurrency)
    counts = {}
    if spec:
        counts = dict(drafts=spec.stats.num_drafts - before.num_drafts,
                      draft_tokens=spec.stats.num_draft_tokens - before.num_draft_tokens,
                      accepted=spec.stats.num_accepted_tokens - before.num_accepted_tokens)
    return sum(map(len, outputs)) / elapsed, outputs, counts


def main(argv=None) -> dict:
    args = parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    loaded = models.load_model(args.model)
    base = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024, kv_cache_memory_bytes=bench_spec.KV_BYTES)
    engines = {"none": LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**base))}
    for method in args.methods.split(","):
        engines[method] = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**base, speculative_config=dict(
            method=method, num_speculative_tokens=max(ks), prompt_lookup_min=2, prompt_lookup_max=5,
            disable_by_batch_size=None, min_acceptance_rate=0.0)))
    systems = [("none", 0)] + [(m, k) for m in args.methods.split(",") for k in ks]

    def run(name, k, requests):
        engine = engines[name]
        if engine.speculator:
            engine.speculator.config = dataclasses.replace(engine.speculator.config, num_speculative_tokens=k)
        return measure(engine, requests, args.concurrency)

    workloads = {w: spec_workloads.make(w, loaded.tokenizer, args.requests, args.max_tokens)
                 for w in args.workloads.split(",")}
    for requests in workloads.values():
        for name, k in systems:
            run(name, k, requests)  # compiles what it meets, untimed
    rates, counts = {}, {}
    for r in range(args.rounds):
        for w, requests in workloads.items():
            reference = None
            for name, k in systems:
                rate, outputs, c = run(name, k, requests)
                reference = reference or outputs
                if outputs != reference:
                    sys.exit(f"{name} k={k} on {w}: greedy outputs differ from no speculation's")
                rates.setdefault((w, name, k), []).append(rate)
                for key, value in c.items():
                    counts.setdefault((w, name, k), {}).setdefault(key, 0)
                    counts[(w, name, k)][key] += value
                print(f"round {r + 1} {w:7s} {name:6s} k={k} {rate:7.1f} tok/s", flush=True)
    print("\n" + machine.one_line(machine.describe()) + " (a shared machine: others' load varies)")
    print(f"concurrency {args.concurrency}, {args.requests} requests of at most {args.max_tokens} tokens, "
          f"medians of {args.rounds} round(s)\n")
    print("| workload | method | k | acceptance rate | mean accepted length | verified drafts | tok/s | vs none |")
    print("|---|---|---|---|---|---|---|---|")
    table = []
    for (w, name, k), values in rates.items():
        none = rates[(w, "none", 0)]
        row = dict(workload=w, method=name, k=k, tok_s=statistics.median(values),
                   ratio=statistics.median(a / b for a, b in zip(values, none)))
        if name != "none":
            c = counts[(w, name, k)]
            steps = c["drafts"]  # verify steps that drafted, summed over rounds
            row.update(acceptance=c["accepted"] / max(c["draft_tokens"], 1), mean_accepted=c["accepted"] / max(steps, 1),
                       drafted=steps)
        table.append(row)
        spec = (f"{row['acceptance']:.0%} | {row['mean_accepted']:.2f} | {row['drafted']}" if name != "none"
                else "- | - | -")
        print(f"| {w} | {name} | {k or '-'} | {spec} | {row['tok_s']:.1f} | {row['ratio']:.2f}x |")
    bench_throughput.write_json(args.json, {"machine": machine.describe(), "rows": table})
    return {"rows": table}


if __name__ == "__main__":
    main()
