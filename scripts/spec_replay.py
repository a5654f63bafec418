"""Proposers compared by decode steps on replayed greedy outputs: no model in the loop, so the counts
hold on any machine.

    python scripts/spec_replay.py [--workloads edit,rewrite,quote,w1] [--requests 4] [--max-tokens 64]
                                  [--k 5] [--max-spec-factor 2] [--show 1]

The workloads' greedy outputs are generated once without speculation (bench_spec.run); then each
request is replayed per proposer as the engine would decode it at concurrency 1: its first output
token comes from the prefill, and each later step proposes up to k drafts from the tokens so far
(capped, as the engine caps them, by the tokens left to max_tokens), accepts the drafts' prefix that
matches the output, and emits that prefix and one token more. Requests run in order, so suffix
decoding's shared trie holds the earlier ones' outputs, as in bench_spec's offline run. Printed per
workload and proposer: decode steps (fewer is better; none takes one per token after the first),
draft tokens proposed and accepted, and tokens verified (each step's last token and its drafts) per
output token, what a step's compute grows with. --show prints that many greedy outputs per workload beside their
overlap with the prompt's last user turn (the share of output tokens inside a run of 8 or more that
the turn holds), to see whether a workload's outputs really repeat their inputs.
"""

import argparse

import numpy as np

import models
import spec_workloads
from bench_spec import run
from paged_jax import EngineConfig, LLMEngine
from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.spec_decode.ngram import propose_ngram
from paged_jax.spec_decode.suffix import SuffixOptions, SuffixProposer


def proposers(max_spec_factor: float | None = None):
    """Name -> (a fresh proposer: (tokens, k) -> drafts, and a finish(output) hook), at
    the config's defaults (suffix decoding's factor overridden where given)."""
    c = SpeculativeConfig()
    factor = c.suffix_decoding_max_spec_factor if max_spec_factor is None else max_spec_factor

    def ngram():
        return (lambda tokens, n: propose_ngram(np.asarray(tokens), n, c.prompt_lookup_min,
                                                     c.prompt_lookup_max).tolist()), (lambda *_: None)

    def suffix():
        s = SuffixProposer(SuffixOptions(c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
                                         c.suffix_decoding_min_token_prob, factor))
        return s.propose, s.finish

    return {"ngram": ngram, "suffix": suffix}


def replay(make, requests, outputs, k: int) -> tuple[int, int, int]:
    """(decode steps, draft tokens, accepted tokens) of one proposer over the requests in order."""
    propose, finish = make()
    steps = drafted = accepted = 0
    for (prompt, max_tokens), out in zip(requests, outputs):
        i = 1  # the first output token comes from the prefill
        while i < len(out):
            drafts = propose(list(prompt) + out[:i], min(k, max_tokens - i - 1)) if max_tokens - i - 1 > 0 else []
            a = 0
            while a < len(drafts) and i + a < len(out) and drafts[a] == out[i + a]:
                a += 1
            steps, drafted, accepted = steps + 1, drafted + len(drafts), accepted + a
            i += a + 1
        finish(out)
    return steps, drafted, accepted


def last_turn(tokenizer, prompt: list[int]) -> list[int]:
    """The prompt from its last user turn on (ChatML's "<|im_start|>user"; all of it without one), so
    that a worked example before it does not count as the text the request asks for."""
    marker = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    for i in range(len(prompt) - len(marker), -1, -1):
        if prompt[i : i + len(marker)] == marker:
            return prompt[i:]
    return prompt


def overlap(prompt: list[int], out: list[int], n: int = 8) -> float:
    """Share of out's tokens inside a run of n or more tokens that prompt also holds."""
    grams = {tuple(prompt[j : j + n]) for j in range(len(prompt) - n + 1)}
    covered = np.zeros(len(out), bool)
    for j in range(len(out) - n + 1):
        if tuple(out[j : j + n]) in grams:
            covered[j : j + n] = True
    return float(covered.mean()) if len(out) else 0.0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--workloads", default=",".join(spec_workloads.KINDS))
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-spec-factor", type=float, help="suffix decoding's (default: the config's)")
    p.add_argument("--show", type=int, default=0, help="greedy outputs to print per workload")
    args = p.parse_args(argv)
    loaded = models.load_model(args.model)
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer,
                       EngineConfig(max_num_seqs=16, max_num_batched_tokens=1024, kv_cache_memory_bytes=1 << 30))
    results = {}
    for kind in args.workloads.split(","):
        requests = spec_workloads.make(kind, loaded.tokenizer, args.requests, args.max_tokens)
        _, outputs, _ = run(engine, requests, len(requests))
        shares = [overlap(last_turn(loaded.tokenizer, list(prompt)), out) for (prompt, _), out in zip(requests, outputs)]
        for (prompt, _), out, share in list(zip(requests, outputs, shares))[: args.show]:
            print(f"--- {kind}: overlap {share:.0%}\n{loaded.tokenizer.decode(prompt)[-300:]!r}\n>>> "
                  f"{loaded.tokenizer.decode(out)!r}")
        row = results[kind] = {"tokens": sum(map(len, outputs)), "overlap": float(np.mean(shares))}
        for name, make in proposers(args.max_spec_factor).items():
            row[name] = dict(zip(("steps", "draft_tokens", "accepted"), replay(make, requests, outputs, args.k)))
        print(f"{kind:8s} {row['tokens']:5d} tokens, overlap {row['overlap']:.0%}  " + "  ".join(
            f"{n} {r['steps']} steps ({r['accepted']}/{r['draft_tokens']} accepted, "
            f"{(r['steps'] + r['draft_tokens']) / max(row['tokens'], 1):.2f} verified an output token)"
            for n, r in row.items() if isinstance(r, dict)), flush=True)
    return results


if __name__ == "__main__":
    main()
