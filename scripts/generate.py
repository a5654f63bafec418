"""Generate with paged-jax: a chat-templated prompt, answered as tokens arrive.

    python scripts/generate.py "Explain PagedAttention in one paragraph"
    python scripts/generate.py --prompts-file prompts.txt --max-tokens 64 --stats
    python scripts/generate.py "Describe a cat" --json-schema cat.schema.json   # JSON that validates

On many hosts (docs/scaling.md), every process runs the same command with its --process-id; process 0
prints the answers, the others follow its steps.
"""

import argparse
import json
import logging
import os
import sys
import time

import jax

from models import DEFAULT_MODEL
from paged_jax import LLMEngine, SamplingParams, StructuredOutputsParams
from paged_jax.core import distributed, host_memory
from paged_jax.core.config import DTYPES
from paged_jax.core.llm import LLM


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="one prompt, answered with streaming")
    p.add_argument("--prompts-file", help="one prompt a line, all batched through the engine")
    p.add_argument("--model", default=DEFAULT_MODEL, help="short name, GGUF file or Hugging Face folder")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to split the model over")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as plain text")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the answers to JSON this schema validates")
    p.add_argument("--stats", action="store_true", help="print throughput and engine counters at the end")
    distributed.add_arguments(p)
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.prompts_file is None):
        p.error("give either a prompt or --prompts-file")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        constraint = None
        if args.json_schema is not None:
            with open(args.json_schema, encoding="utf-8") as f:
                constraint = StructuredOutputsParams(json=json.load(f))
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens, structured_outputs=constraint)
    except (OSError, ValueError) as e:
        sys.exit(f"generate.py: {e}")
    distributed.initialize_from_args(args)
    try:
        engine = LLMEngine.from_pretrained(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    except FileNotFoundError as e:  # a model name or path that names nothing
        sys.exit(f"generate.py: {e}")
    if distributed.is_follower():
        distributed.follow(engine.runner)
        return 0
    llm = LLM.from_engine(engine)
    texts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts_file)
    prompts = texts if args.no_chat_template else [llm.chat_prompt([{"role": "user", "content": t}]) for t in texts]

    start = time.perf_counter()
    if len(prompts) == 1 and args.n == 1:
        outputs = [_stream(llm.engine, prompts[0], params)]
    else:
        try:
            outputs = llm.generate(prompts, params)
        except ValueError as e:  # a prompt too long, a schema that does not compile
            sys.exit(f"generate.py: {e}")
        for text, out in zip(texts, outputs):
            print(f"### {text}")
            for completion in out.outputs:
                print(completion.text, end="\n\n")
    elapsed = time.perf_counter() - start
    errors = [out.error for out in outputs if out.error is not None]
    for error in errors:
        print(f"generate.py: a request failed: {error}", file=sys.stderr)
    if args.stats:
        _print_stats(llm.engine, outputs, elapsed)
    return 1 if errors else 0


def _stream(engine: LLMEngine, prompt, params):
    engine.add_request(prompt, params)
    shown, last = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown, last = len(text), out
    sys.stdout.write("\n")
    return last


def _read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def _print_stats(engine: LLMEngine, outputs, elapsed: float) -> None:
    stats = engine.stats()
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
    rows = [
        ("output tokens", generated),
        ("wall time (s, compiles included)", f"{elapsed:.2f}"),
        ("output tokens/s", f"{generated / elapsed:.1f}"),
        ("mean time to first token (s)", f"{sum(ttfts) / len(ttfts):.3f}" if ttfts else "-"),
        ("peak KV blocks in use", f"{stats.peak_blocks_in_use} of {engine.blocks.num_blocks - 1}"),
        ("preemptions", stats.num_preemptions),
        ("prefix-cache hit blocks", f"{stats.prefix_cache_hit_blocks} of {stats.prefix_cache_queried_blocks} queried"),
        ("compiles", stats.num_compiles),
        ("attention backend", f"{stats.attention_backend} ({stats.attention_backend_reason})"),
        ("matmul backend", f"{stats.matmul_backend} ({stats.matmul_backend_reason})"),
    ]
    print("\n--- stats ---", file=sys.stderr)
    for name, value in rows:
        print(f"{name:>34}: {value}", file=sys.stderr)


if __name__ == "__main__":
    host_memory.restart_with_tunables()
    status = main()
    if jax.process_count() > 1:  # the group's shutdown, at exit, waits for every process
        sys.exit(status)
    # The job is done and its output written: the process ends here, without the interpreter's teardown of
    # XLA's client, its threads and the kernels' libraries, which has nothing left to keep and, once in
    # CI (stop 47, after the stats), aborted the process at exit ("terminate called without an active
    # exception"; not seen in 30 runs here since, cold and warm).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)
