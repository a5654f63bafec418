"""Speculative decoding against none, side by side in one run: output tokens/s at each concurrency.

    python scripts/bench_spec.py [--rounds 3] [--methods ngram,suffix] [--concurrency 1,4,16]
                                 [--edit-requests 8] [--w1-requests 16] [--json out/spec.json]

Workloads:
- edit: code to be returned whole with one name changed ("rewrite this code with X renamed to Y"),
  made from functions of Python's own standard library (inspect.getsource), chat-templated for the
  model; its output repeats its input, which prompt lookup and suffix decoding draft from;
- w1: W1's first --w1-requests requests (../shared/workloads/w1.json), random prompts where nothing
  repeats.
Every system is an engine over one loaded model (the default SmolLM2-135M-Instruct): no speculation,
then one per --methods. Each first runs every workload at every concurrency once untimed, which
compiles the shapes they meet (--full-warmup: every shape, warmup.py, which takes long on a loaded
machine). A round runs each workload at each
concurrency through each system in turn (so a drift in the machine's speed hits all alike): requests
are kept --concurrency at a time in the engine (closed loop), greedy, EOS ignored. Greedy tokens must
be the same with and without speculation (the script fails otherwise). Suffix decoding's cache of
finished outputs is emptied before each run: within a run it learns from the requests finished
earlier in it, never from the same requests' outputs in an earlier run. It prints each system's
median output tokens/s, its ratio to no speculation, and speculation's acceptance (mean accepted
tokens per verified draft, and the share of draft tokens accepted).
"""

import argparse
import ast
import dataclasses
import inspect
import json
import pathlib
import statistics
import sys
import time

import bench_throughput
import models
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.core.llm import chat_prompt
from paged_jax.core.warmup import warm_up
from paged_jax.research import machine

# Standard-library modules whose functions the edit workload rewrites: plain Python, a few dozen lines each.
EDIT_SOURCES = ("textwrap", "shlex", "fnmatch", "colorsys", "heapq", "bisect", "glob", "keyword")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--edit-requests", type=int, default=8)
    p.add_argument("--w1-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=192, help="cap on each request's output")
    p.add_argument("--workloads", default="edit,w1")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--full-warmup", action="store_true", help="warm every shape up first (warmup.py)")
    p.add_argument("--json")
    return p.parse_args(argv)


def edit_prompts(tokenizer, n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) of n edit requests: a stdlib function and a rename within it."""
    out = []
    for name in EDIT_SOURCES:
        module = __import__(name)
        for node in ast.parse(inspect.getsource(module)).body:
            if len(out) == n:
                return out
            if not isinstance(node, ast.FunctionDef) or not 8 <= node.end_lineno - node.lineno <= 40:
                continue
            code = ast.get_source_segment(inspect.getsource(module), node)
            args = [a.arg for a in node.args.args]
            old = args[0] if args else node.name
            message = (f"Rewrite this Python function with `{old}` renamed to `{old}_value`. Change nothing "
                       f"else and answer with the whole function only.\n\n```python\n{code}\n```")
            ids = chat_prompt(tokenizer, [{"role": "user", "content": message}])
            code_tokens = len(tokenizer.encode(code))
            out.append((list(ids), min(max_tokens, code_tokens + 16)))
    return out


def w1_prompts(n: int, max_tokens: int) -> list[tuple[list[int], int]]:
    workload = bench_throughput.load_workload(bench_throughput.DEFAULT_WORKLOAD)
    return [(r["prompt_token_ids"], min(max_tokens, r["max_new_tokens"])) for r in workload["requests"][:n]]


def run(engine: LLMEngine, requests, concurrency: int) -> tuple[float, list[list[int]]]:
    """Seconds to finish the requests kept `concurrency` at a time, and their output tokens."""
    engine.blocks.reset_prefix_cache()
    if engine.speculator is not None:  # suffix decoding would otherwise find this run's outputs from the last
        engine.speculator.forget_outputs()
    queue = list(enumerate(requests))
    outputs: dict[str, list[int]] = {}
    order = {}
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            i, (prompt, max_tokens) = queue.pop(0)
            rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            order[rid] = i
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    return elapsed, [outputs[rid] for rid in sorted(outputs, key=order.get)]


def main(argv=None) -> dict:
    args = parse_args(argv)
    loaded = models.load_model(args.model)
    base = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024)
    systems = {"none": EngineConfig(**base)}
    for method in filter(None, args.methods.split(",")):
        systems[method] = EngineConfig(**base, speculative_config=dict(
            method=method, num_speculative_tokens=args.k, prompt_lookup_min=2, prompt_lookup_max=5))
    engines = {}
    for name, config in systems.items():
        engines[name] = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, config)
        if args.full_warmup:
            warm_up(engines[name])
    workloads = {"edit": edit_prompts(loaded.tokenizer, args.edit_requests, args.max_tokens),
                 "w1": w1_prompts(args.w1_requests, args.max_tokens)}
    workloads = {w: workloads[w] for w in args.workloads.split(",")}
    levels = [int(c) for c in args.concurrency.split(",")]
    rates: dict[tuple, list[float]] = {}
    acceptance: dict[tuple, list[tuple[int, int, int]]] = {}
    for w, requests in workloads.items():
        for c in levels:
            for engine in engines.values():
                run(engine, requests, c)  # compiles what it meets, untimed
    for r in range(args.rounds):
        for w, requests in workloads.items():
            for c in levels:
                reference = None
                for name, engine in engines.items():
                    before = dataclasses.replace(engine.speculator.stats) if engine.speculator else None
                    elapsed, tokens = run(engine, requests, c)
                    if reference is None:
                        reference = tokens
                    elif tokens != reference:
                        sys.exit(f"{name} on {w} at concurrency {c}: greedy tokens differ from no speculation")
                    rates.setdefault((w, c, name), []).append(sum(map(len, tokens)) / elapsed)
                    if before is not None:
                        s = engine.speculator.stats
                        acceptance.setdefault((w, c, name), []).append(
                            (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
                             s.num_accepted_tokens - before.num_accepted_tokens))
                    print(f"round {r + 1} {w:5s} c={c:<3d} {name:7s} {rates[(w, c, name)][-1]:8.1f} tok/s", flush=True)
    print("\n" + machine.one_line(machine.describe()) + " (a shared machine: others' load varies)")
    print(f"medians of {args.rounds} rounds, output tok/s (ratio to none); acceptance: mean accepted per "
          f"draft, share of draft tokens accepted")
    figures = {}
    for w in workloads:
        for c in levels:
            none = statistics.median(rates[(w, c, "none")])
            row = [f"{w:5s} c={c:<3d} none {none:7.1f}"]
            for name in engines:
                if name == "none":
                    continue
                median = statistics.median(rates[(w, c, name)])
                drafts, draft_tokens, accepted = map(sum, zip(*acceptance[(w, c, name)]))
                row.append(f"{name} {median:7.1f} ({median / none:.2f}x; {accepted / max(drafts, 1):.2f}, "
                           f"{accepted / max(draft_tokens, 1):.0%})")
                figures[f"{w}/c{c}/{name}"] = dict(tok_s=median, ratio=median / none, drafts=drafts,
                                                   draft_tokens=draft_tokens, accepted=accepted)
            figures[f"{w}/c{c}/none"] = dict(tok_s=none)
            print("  ".join(row))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))
    return figures


if __name__ == "__main__":
    main()
