"""What the lower precisions cost in accuracy, to set beside their speed (bench_peers.py --precisions).

    python scripts/eval_precision.py [--precisions kv-bf16] [--max-text-tokens 8192] [--json out/precision.json]

For float32 and each precision (bench_throughput.PRECISIONS), on the same model:
- perplexity of a fixed natural-language text that ships with Python, so every machine has it
  offline: the reference documentation in pydoc_data/topics.py, every topic in sorted order, cut to
  its first --max-text-tokens tokens, scored in windows of --context tokens as fresh sequences, each
  in prefill chunks of --chunk (paged_jax/research/perplexity.py: the engine's own weights, KV cache
  and attention). The text differs between Python versions: its sha256 is printed, and figures
  compare only between runs of one text;
- greedy-token agreement with float32 on fixed chat prompts (PROMPTS), --steps tokens each: how many
  completions are identical, the mean share of tokens matching before the first difference, and
  where one parts, float32's logprob gap between its token and the other there (small: a near-tie).
"""

import argparse
import hashlib
import sys

import numpy as np
import pydoc_data.topics

import bench_throughput
import models
from bench_peers import agreement
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
from paged_jax.research import machine
from paged_jax.research.perplexity import perplexity

# The test suite's chat prompts and the README's.
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is and when to use one.",
    "What causes the seasons on Earth?",
    "Explain PagedAttention in one paragraph",
    "What is PagedAttention?",
    "The capital of France is",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--precisions", default=",".join(bench_throughput.PRECISIONS),
                   help=f"comma-separated, of {', '.join(bench_throughput.PRECISIONS)}")
    p.add_argument("--max-text-tokens", type=int, default=8192)
    p.add_argument("--context", type=int, default=1024, help="tokens per scored window")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    args.precisions = [name for name in args.precisions.split(",") if name]
    if unknown := set(args.precisions) - set(bench_throughput.PRECISIONS):
        p.error(f"unknown --precisions {sorted(unknown)}")
    return args


def reference_text() -> str:
    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def greedy(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=2)
    return [o.outputs[0] for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]


def compare(outputs, reference, steps: int) -> dict:
    """Greedy agreement of `outputs` with float32's `reference` (CompletionOutputs with logprobs)."""
    ours, theirs = [o.token_ids for o in outputs], [r.token_ids for r in reference]
    matched = agreement(theirs, ours, len(theirs), steps)
    gaps = []
    for prefix, mine, ref in zip(matched["matching_prefix"], outputs, reference):
        if prefix < steps:  # float32's logprob of its own token less that of the one chosen here
            chosen = ref.logprobs[prefix]
            gaps.append(round(chosen[ref.token_ids[prefix]] - chosen.get(mine.token_ids[prefix], -np.inf), 4))
    return {"identical": matched["matching_prefix"].count(steps), "of": len(theirs),
            "agreement": round(matched["agreement"], 4), "matching_prefix": matched["matching_prefix"],
            "logprob_gap_where_parted": gaps}


def main(argv=None) -> dict:
    args = parse_args(argv)
    loaded = models.load_model(args.model)
    text = reference_text()
    tokens = loaded.tokenizer.encode(text, add_special_tokens=False)[: args.max_text_tokens]
    options = {"float32": {}} | {name: bench_throughput.PRECISIONS[name] for name in args.precisions}
    engines = {name: LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(**changes))
               for name, changes in options.items()}
    chat = LLM.from_engine(engines["float32"])
    prompts = [chat.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS[: args.num_prompts]]
    figures = {
        "machine": machine.describe(),
        "model": args.model,
        "text": {"source": "pydoc_data/topics.py", "python": sys.version.split()[0],
                 "sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "tokens": len(tokens),
                 "context": args.context, "chunk": args.chunk},
        "rows": {},
    }
    reference = None
    for name, engine in engines.items():
        row = perplexity(engine, tokens, context=args.context, chunk=args.chunk)
        outputs = greedy(engine, prompts, args.steps)
        if reference is None:
            reference, base = outputs, row["perplexity"]
        else:
            row["perplexity_change_pct"] = round(100 * (row["perplexity"] / base - 1), 3)
            row["greedy"] = compare(outputs, reference, args.steps)
        row |= {"kv_cache_dtype": engine.resolved.kv_cache_dtype,
                "attention_backend": engine.resolved.attention_backend}
        figures["rows"][name] = row
        print(f"{name:>10}: perplexity {row['perplexity']:.4f}"
              + (f" ({row['perplexity_change_pct']:+.3f}% against float32); greedy: {row['greedy']['identical']} of "
                 f"{row['greedy']['of']} completions identical, agreement {row['greedy']['agreement']:.3f}, "
                 f"logprob gaps where parted {row['greedy']['logprob_gap_where_parted']}" if "greedy" in row else ""),
              flush=True)
    print(machine.one_line(figures["machine"]))
    print(f"text: {figures['text']}")
    if args.json:
        bench_throughput.write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
