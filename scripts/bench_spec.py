"""Speculative decoding against none, side by side in one run: output tokens/s per workload, concurrency
and way of serving (in the process, and through the OpenAI server).

    python scripts/bench_spec.py [--rounds 3] [--methods ngram,suffix] [--concurrency 1,4,16]
                                 [--workloads edit,rewrite,quote,w1] [--modes offline,server]
                                 [--requests 2] [--waves 1] [--max-tokens N] [--control] [--same-requests]
                                 [--json out/spec.json]

Workloads (spec_workloads.py): (a) outputs that repeat their inputs, from what Python ships: `edit`
(a stdlib function returned whole with one name changed), `rewrite` (a stdlib docstring copied with
one word in capitals), `quote` (document QA: a document of five stdlib docstrings, 850 to 1,100
tokens, and requests each asking for one of its passages whole, 90 to 290 tokens; a document's
requests come one after another, sharing it as a prefix);
(b) `w1`, W1's first requests (../shared/workloads/w1.json), where nothing repeats. A cell (workload,
concurrency c) has max(waves x c, --requests) requests, each at most --max-tokens long (default: the
workload's, spec_workloads.MAX_TOKENS: 300 for quote's whole passages, 64 for the others), greedy, EOS
ignored, kept c at a time (closed loop). A c = 16 cell of one wave is one run of a few seconds, which
the machine's hiccups move by more than 3% (an engine identical to none read 0.88 to 1.03x): --waves 3
or more there.

Systems: no speculation, then one per --methods (k = --k, prompt lookup 2 to 5, disable_by_batch_size
at the config's default unless --disable-by-batch-size; 0 never turns it off); --control adds a second
engine without speculation, whose ratio to none is what noise alone gives a system. Offline, each is an
engine over one loaded model, which first runs every cell once untimed (that compiles the shapes they
meet); prefix cache and suffix decoding's cache of finished outputs are emptied before each run (a
run learns from the requests finished earlier in it, never from an earlier run's). Through the
server, `python -m paged_jax.serve` is started per system on loopback (each warms up before /ready)
and kept for the whole run, driven by serving_client.closed_loop (every other request streamed);
each cell of each round sends the workload's next requests, which no server has seen before (suffix
decoding learns from the earlier cells' outputs there, as a server does from its traffic); where a
workload has fewer requests than the cells and rounds take (edit has 90, rewrite 51, W1 64), the
later cells wrap round to its first requests, said when it starts. --same-requests has the offline
cells take the same requests as the servers' in each round (served against offline on the same
traffic; default: the first ones, every round). The modes run one after the other (offline's rounds,
then the servers'), so engines and servers never share memory.

Rounds alternate the systems cell by cell (a drift in the machine's speed hits all alike), their
order rotated by one each round (none is always first, or last, in a cell). Greedy
outputs must be identical with and without speculation, tokens offline and texts through the server
(the script fails otherwise). It prints, per cell and system, the median over rounds of the round's
ratio to no speculation, none's median tok/s, acceptance (mean accepted tokens per verified draft,
and the share of draft tokens accepted; served, from the server's /metrics), the median engine
steps a run took, and the compiles and preemptions timed runs met (none expected; served, from
/metrics). --vllm-python adds vLLM (its CPU build) with and without its n-gram speculation on (a),
offline (peer_driver.py).
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import shlex
import statistics
import sys
import time

import bench_serving
import bench_throughput
import models
import spec_workloads
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.research import machine
from serving_client import closed_loop, server_counters

# KV cache of each engine and server: enough for 16 sequences of the longest workload (quote, about
# 1,000 tokens) on SmolLM2; half the host default, so that three servers fit beside others' work.
KV_BYTES = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--workloads", default=",".join(spec_workloads.KINDS))
    p.add_argument("--modes", default="offline,server")
    p.add_argument("--requests", type=int, default=2, help="requests of a cell below this concurrency")
    p.add_argument("--waves", type=int, default=1,
                   help="a cell at concurrency c has at least waves x c requests (c = 16 needs 3 to resolve 3%%)")
    p.add_argument("--max-tokens", type=int, help="cap on each request's output (default: the workload's)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--disable-by-batch-size", type=int,
                   help="speculation off from this many running sequences (0: never; default: the config's)")
    p.add_argument("--control", action="store_true",
                   help="also a second engine without speculation: the ratio a system reads for nothing")
    p.add_argument("--vllm-python", help="also vLLM's CPU build from this virtualenv, with and without n-gram")
    p.add_argument("--same-requests", action="store_true",
                   help="offline, each round takes the requests the servers take in it (default: the first, every round)")
    p.add_argument("--json")
    return p.parse_args(argv)


def spec_configs(args) -> dict[str, dict | None]:
    """System name -> speculative_config (None: no speculation)."""
    systems = {"none": None}
    for method in filter(None, args.methods.split(",")):
        config = dict(method=method, num_speculative_tokens=args.k, prompt_lookup_min=2, prompt_lookup_max=5)
        if args.disable_by_batch_size is not None:
            config["disable_by_batch_size"] = args.disable_by_batch_size or None
        systems[method] = config
    if args.control:  # its ratio to none shows what noise alone gives
        systems["none-again"] = None
    return systems


def run(engine: LLMEngine, requests, concurrency: int) -> tuple[float, list[list[int]], int]:
    """Seconds to finish the requests kept `concurrency` at a time, their output tokens, engine steps."""
    engine.blocks.reset_prefix_cache()
    if engine.speculator is not None:  # suffix decoding would otherwise find this run's outputs from the last
        engine.speculator.forget_outputs()
    queue = list(enumerate(requests))
    outputs: dict[str, list[int]] = {}
    order = {}
    steps = 0
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and engine.num_unfinished_requests < concurrency:
            i, (prompt, max_tokens) = queue.pop(0)
            rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            order[rid] = i
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    return elapsed, [outputs[rid] for rid in sorted(outputs, key=order.get)], steps


class Offline:
    """The systems as engines in this process."""

    def __init__(self, args, loaded, systems, cells):
        base = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024, kv_cache_memory_bytes=KV_BYTES)
        self.engines = {name: LLMEngine(loaded.model, loaded.config, loaded.tokenizer,
                                        EngineConfig(**base, speculative_config=config))
                        for name, config in systems.items()}
        for requests, c in cells:
            for engine in self.engines.values():
                run(engine, requests, c)  # compiles what it meets, untimed

    def round(self, name, requests, c):
        """(output tokens/s, outputs to compare, (drafts, draft tokens, accepted) or None, what else
        the run met: compiles, preemptions, engine steps)."""
        engine = self.engines[name]
        before = dataclasses.replace(engine.speculator.stats) if engine.speculator else None
        was = engine.stats()
        elapsed, tokens, steps = run(engine, requests, c)
        now = engine.stats()
        seen = dict(compiles=now.num_compiles - was.num_compiles, preemptions=now.num_preemptions - was.num_preemptions,
                    steps=steps)
        counts = None
        if before is not None:
            s = engine.speculator.stats
            counts = (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
                      s.num_accepted_tokens - before.num_accepted_tokens)
        return sum(map(len, tokens)) / elapsed, tokens, counts, seen


def servers(args, systems, stack: contextlib.ExitStack) -> dict[str, str]:
    """System name -> the URL of its server, each started (and warmed up) in turn, stopped with stack."""
    urls = {}
    for name, config in systems.items():
        flags = f"--max-num-seqs {args.max_num_seqs} --kv-cache-memory-bytes {KV_BYTES}"
        if config is not None:
            flags += f" --speculative-config {shlex.quote(json.dumps(config))}"
        urls[name] = stack.enter_context(bench_serving.paged_jax_server(argparse.Namespace(model=args.model,
                                                                                           server_args=flags)))
    return urls


COUNTERS = ("num_compiles", "num_preemptions", "engine_step_time_seconds", "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def serve(url: str, requests, c: int, model: str) -> tuple[float, list[str], tuple, dict]:
    """(output tok/s, texts, (drafts, draft tokens, accepted), what else the server counted meanwhile:
    compiles, preemptions, engine steps) of the requests sent to a server c at a time."""
    body = [{"prompt_token_ids": p, "max_new_tokens": m} for p, m in requests]
    before = server_counters(url, COUNTERS)
    results, elapsed = asyncio.run(closed_loop(url, body, c, model))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        sys.exit(f"{url}: {errors[0]}")
    d = {k: int(v - before[k]) for k, v in server_counters(url, COUNTERS).items()}
    spec = (d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"], d["spec_decode_num_accepted_tokens"])
    seen = dict(compiles=d["num_compiles"], preemptions=d["num_preemptions"], steps=d["engine_step_time_seconds"])
    return sum(r["output_tokens"] for r in results) / elapsed, [r["text"] for r in results], spec, seen


def summarize(args, rates, acceptance, seen) -> dict:
    print("\n" + machine.one_line(machine.describe()) + " (a shared machine: others' load varies)")
    print(f"medians over {args.rounds} rounds of each round's ratio to none (none: median output tok/s); "
          "acceptance: mean accepted per draft, share of draft tokens accepted; median engine steps a run; "
          "compiles and preemptions in timed runs, if any")
    figures = {}
    for key in dict.fromkeys(k[:3] for k in rates):
        names = [k[3] for k in rates if k[:3] == key]
        row = [f"{key[0]:7s} {key[1]:7s} c={key[2]:<3d} none {statistics.median(rates[(*key, 'none')]):6.1f} tok/s"]
        for name in names:
            # vLLM's speculation against vLLM without it; the rest (vLLM's plain too) against our none
            base = rates[(*key, "vllm" if name == "vllm-ngram" else "none")]
            ratio = statistics.median(a / b for a, b in zip(rates[(*key, name)], base))
            figure = figures["/".join(map(str, (*key, name)))] = dict(ratio=ratio, tok_s=statistics.median(rates[(*key, name)]))
            text = "" if name == "none" else f"{name} {ratio:.2f}x"
            if acceptance.get((*key, name)):
                drafts, draft_tokens, accepted = map(sum, zip(*acceptance[(*key, name)]))
                figure.update(drafts=drafts, draft_tokens=draft_tokens, accepted=accepted)
                text += f" ({accepted / max(drafts, 1):.2f}, {accepted / max(draft_tokens, 1):.0%})"
            if seen.get((*key, name)):
                met = seen[(*key, name)]
                figure.update(steps=statistics.median(m["steps"] for m in met),
                              **{k: sum(m[k] for m in met) for k in ("compiles", "preemptions")})
                text += f" {figure['steps']:.0f} steps" + "".join(
                    f", {figure[k]} {k}" for k in ("compiles", "preemptions") if figure[k])
            row.append(text.strip())
        print("  ".join(row))
    return figures


def main(argv=None) -> dict:
    args = parse_args(argv)
    loaded = models.load_model(args.model)
    systems = spec_configs(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    kinds = args.workloads.split(",")
    modes = args.modes.split(",")
    # Offline, every round runs a cell's same requests (its caches emptied before each run); through
    # the server, every cell of every round takes the workload's next requests, which no server has
    # seen (offline too with --same-requests).
    size = {c: max(c * args.waves, args.requests) for c in levels}  # requests of a cell
    most = max(max(size.values()), sum(size.values()) * (args.rounds if "server" in modes or args.same_requests else 0))
    pool = {w: spec_workloads.make(w, loaded.tokenizer, most, args.max_tokens or spec_workloads.MAX_TOKENS[w])
            for w in kinds}
    for w, requests in pool.items():
        if len(requests) < most:
            print(f"{w}: {len(requests)} requests, {most} asked: the servers' later cells repeat earlier requests")
    cells = [(w, c, (pool[w] * most)[: size[c]]) for w in kinds for c in levels]
    sent, fresh = dict.fromkeys(kinds, 0), {}  # requests of each workload taken so far; (round, w, c) -> requests
    for r in range(args.rounds):
        for w, c, _ in cells:
            fresh[r, w, c] = [pool[w][(sent[w] + j) % len(pool[w])] for j in range(size[c])]
            sent[w] += size[c]
    offline_cells = {(r, w, c): fresh[r, w, c] if args.same_requests else requests
                     for r in range(args.rounds) for w, c, requests in cells}
    rates: dict[tuple, list[float]] = {}
    acceptance: dict[tuple, list] = {}
    seen: dict[tuple, list[dict]] = {}  # per round: compiles, preemptions, engine steps
    reference: dict[tuple, list] = {}  # this round's first outputs per cell, which all must equal (ours; vLLM's)

    def record(key, name, rate, outputs, counts=None, met=None):
        rates.setdefault((*key, name), []).append(rate)
        if counts is not None:
            acceptance.setdefault((*key, name), []).append(counts)
        same = reference.setdefault((*key, "vllm" if name.startswith("vllm") else "ours"), outputs)
        if outputs != same:
            sys.exit(f"{name} on {key}: greedy outputs differ from the other systems' this round")
        line = f"round {len(rates[(*key, name)])} {' '.join(map(str, key)):20s} {name:12s} {rate:8.1f} tok/s"
        if met is not None:
            seen.setdefault((*key, name), []).append(met)
            line += f" {met['steps']:5d} steps" + "".join(f", {met[k]} {k}" for k in ("compiles", "preemptions") if met[k])
        print(line, flush=True)

    vllm = None
    for mode in modes:  # one after the other: the engines of one and the servers of the other never together
        with contextlib.ExitStack() as stack:  # servers and peers stopped however the run ends
            warm = {id(q): (w, c, q) for (_, w, c), q in offline_cells.items()}  # each run once
            offline = Offline(args, loaded, systems, [(q, c) for _, c, q in warm.values()]) if mode == "offline" else None
            if args.vllm_python and mode == "offline":
                import spec_vllm
                vllm = spec_vllm.Peer(args, [q for w, _, q in warm.values() if w != "w1"])
                stack.callback(vllm.close)
            urls = servers(args, systems, stack) if mode == "server" else {}
            for r in range(args.rounds):
                order = list(systems)[r % len(systems):] + list(systems)[: r % len(systems)]
                reference.clear()
                for w, c, _ in cells:
                    if offline is not None:
                        for name in order:
                            record(("offline", w, c), name, *offline.round(name, offline_cells[r, w, c], c))
                    if vllm is not None and w != "w1":  # workload (a) only
                        for name, rate, tokens in vllm.round(offline_cells[r, w, c], c):
                            record(("offline", w, c), name, rate, tokens)
                    if urls:
                        for name in order:  # a server without speculation counts no drafts
                            rate, texts, spec, met = serve(urls[name], fresh[r, w, c], c, args.model)
                            record(("server", w, c), name, rate, texts, spec if systems[name] else None, met)
            del offline
    figures = summarize(args, rates, acceptance, seen)
    if vllm is not None and vllm.refusal:
        figures["vllm_refused_speculation"] = vllm.refusal
        print(f"vLLM refused its n-gram speculation: {vllm.refusal}")
    bench_throughput.write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
