"""Offline throughput on a shared workload (default ../shared/workloads/w1.json), default model.

    python scripts/bench_throughput.py [--json out/w1.json] [--tensor-parallel-size N]

Prints output and total tokens/s over the wall time of one `LLM.generate` call (what a user of the
offline API waits for) after a warm-up run, the prefix cache emptied between them, model FLOP
utilisation against a matmul peak measured in the same process in the engine's dtype, peak KV blocks
in use and how full their slots were, preemptions, and compiles after warm-up. Where the workload file
is missing, W1 is made again from its recipe (../shared/workloads/README.md).

A served run of the same workload compares with this one only if the server computes every prompt
too: a server warmed up on the workload's own prompts keeps them in its prefix cache and skips most
of the prefill (W1: 15,424 of its 17,709 prompt tokens), which once made W1 look 40% faster served
than offline. Its /metrics counter paged_jax:prefix_cache_hits_total says whether that happened;
prefix_hit_tokens here says the same of this run (0).

With --tensor-parallel-size N > 1 it also runs the workload's first requests again under the JAX
profiler and reports the time per step spent in collectives (all-reduce, all-gather, ...), averaged
over the devices. On the CPU a collective's time includes waiting for the slowest device to arrive.
To try N devices on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

import argparse
import json
import pathlib
import re
import sys
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models import DEFAULT_MODEL
from paged_jax import LLM, LLMEngine, SamplingParams
from kernels_pallas.layout import LAYOUTS
from paged_jax.core import host_memory
from paged_jax.research import machine, step_profile
from paged_jax.core.config import DTYPES, KV_CACHE_DTYPES, MATMUL_BACKENDS
from paged_jax.research.machine_peaks import matmul_peak_gflops

DEFAULT_WORKLOAD = pathlib.Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1.json"
# The lower precisions offered beside float32, never as the headline: the engine options each changes
# (bench_peers.py --precisions runs them as extra rows, eval_precision.py measures their accuracy).
PRECISIONS = {"kv-bf16": dict(kv_cache_dtype="bfloat16"), "int8": dict(quantization="int8")}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The workload and engine options every throughput script shares (make_engine reads them)."""
    p.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=None,
                   help="default: the attention backend's (paged_jax/core/config.py)")
    p.add_argument("--kv-layout", choices=("auto", *LAYOUTS), default="auto",
                   help="of the KV pages (kernels_pallas/layout.py)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="of the KV cache alone (auto: --dtype's); bfloat16 under float32 weights: a precision row")
    p.add_argument("--quantization", choices=("int8",), default=None,
                   help="int8: the layers' weights in int8, activations quantized per token: a precision row")
    p.add_argument("--matmul-backend", choices=MATMUL_BACKENDS, default="auto",
                   help="auto: the C++ kernel over packed weights for float32 on one CPU device, else XLA")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="schedule step N+1 while step N runs (auto: on a GPU, off on the CPU)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to split the model over")
    p.add_argument("--profile-requests", type=int, default=8,
                   help="with tensor parallelism: requests of the profiled run that times collectives")
    p.add_argument("--no-warmup", action="store_true", help="time the first run, compiles included")
    p.add_argument("--profile", action="store_true",
                   help="then run the workload again under the JAX profiler and print where the steps' time goes "
                        "(paged_jax/research/step_profile.py)")
    p.add_argument("--json", help="write the figures to this path")
    return p.parse_args(argv)


def load_workload(path) -> dict:
    """The workload file; W1 made from its recipe where the default file is missing (a GPU machine
    with only the project's code)."""
    path = pathlib.Path(path)
    if path.exists() or path != DEFAULT_WORKLOAD:
        return json.loads(path.read_text())
    rng = np.random.default_rng(0)
    lengths = rng.integers(32, 513, size=64)
    requests = [dict(id=i, prompt_token_ids=rng.integers(1000, 40000, size=int(n)).tolist(),
                     max_new_tokens=(32, 128, 64, 256)[i % 4]) for i, n in enumerate(lengths)]
    return dict(name="W1", requests=requests)


def model_flops(cfg, requests) -> float:
    """Matmul and attention FLOPs the workload needs (logits only for sampled rows)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * d + 3 * d * cfg.intermediate_size
    total = 0.0
    for r in requests:
        prompt, out = len(r["prompt_token_ids"]), r["max_new_tokens"]
        tokens = prompt + out - 1  # the last sampled token is never fed back
        total += 2 * cfg.num_layers * per_layer * tokens
        total += 2 * cfg.vocab_size * d * out
        # Attention: QK^T and PV over the causal context of every computed token.
        total += 4 * cfg.num_layers * cfg.num_heads * hd * (tokens * (tokens + 1) / 2)
    return total


def make_engine(args) -> LLMEngine:
    """The engine add_engine_args' options describe."""
    return LLMEngine.from_pretrained(args.model, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                                     max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                                     kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
                                     matmul_backend=args.matmul_backend, kv_layout=args.kv_layout,
                                     tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                                     async_scheduling=getattr(args, "async_scheduling", "auto"))


def workload_requests(args) -> tuple[dict, list[dict], list[SamplingParams]]:
    """(workload, its first --num-requests requests, greedy parameters for each: EOS ignored)."""
    workload = load_workload(args.workload)
    requests = workload["requests"][: args.num_requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True) for r in requests]
    return workload, requests, params


class Run(NamedTuple):
    elapsed: float  # seconds of the whole LLM.generate call
    produced: int  # output tokens
    token_ids: list[list[int]]  # each request's output tokens, in the order of `requests`
    prefix_hit_tokens: int  # prompt tokens the prefix cache served instead of computing them


def run_workload(engine: LLMEngine, requests, params) -> Run:
    """One run of the requests as a user of the offline API meets it: a single `LLM.generate` call
    (admission, every step, the outputs), timed whole.

    Prompts the prefix cache still holds from an earlier run are not computed again, which makes a
    run look far faster than a first one (W1 a second time skips 15,424 of its 17,709 prompt
    tokens): callers reset the cache first, and prefix_hit_tokens says whether it served any."""
    llm = LLM.from_engine(engine)
    prompts = [r["prompt_token_ids"] for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    return Run(elapsed, sum(map(len, token_ids)), token_ids, sum(out.metrics.num_prefix_hit_tokens for out in outputs))


def run_once(engine: LLMEngine, requests, params) -> tuple[float, int]:
    """(seconds, output tokens) of one run of the requests, every prompt computed (the prefix cache
    emptied first)."""
    engine.blocks.reset_prefix_cache()
    run = run_workload(engine, requests, params)
    return run.elapsed, run.produced


_COLLECTIVE = re.compile(r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|nccl", re.I)


def collective_ms_per_step(engine: LLMEngine, requests, params) -> tuple[float, int]:
    """(ms per step per device in collective ops, steps) over a run of `requests` under the profiler.

    Events are read from the device planes where there are any (a GPU), else from the host's XLA
    threads (the CPU, where every device runs on the host)."""
    from jax.profiler import ProfileData

    steps = 0
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            for i, r in enumerate(requests):
                engine.add_request(r["prompt_token_ids"], params[i])
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
        finally:
            jax.profiler.stop_trace()
        trace = next(pathlib.Path(folder).rglob("*.xplane.pb"))
        # A list: the planes come as an iterator, which the search for device planes would use up (and
        # every collective with it: the figure was always 0 on the CPU).
        planes = list(ProfileData.from_file(str(trace)).planes)
    device = [p for p in planes if p.name.startswith("/device:")]
    lines = [line for p in device for line in p.lines] if device else [
        line for p in planes if p.name.startswith("/host:") for line in p.lines if line.name.startswith("tf_XLA")]
    total_ns = sum(event.duration_ns for line in lines for event in line.events if _COLLECTIVE.search(event.name))
    return total_ns / 1e6 / max(steps, 1) / engine.config.tensor_parallel_size, steps


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.profile and jax.default_backend() != "cpu":
        # Caught before the workload runs: the profile attributes the host CPU's XLA op events.
        sys.exit(f"--profile reads XLA's ops on the host CPU; this run would be on {jax.default_backend()}")
    workload, requests, params = workload_requests(args)
    engine = make_engine(args)
    if not args.no_warmup:
        run_workload(engine, requests, params)
    compiles_before = engine.runner.num_compiles
    preempt_before = engine.scheduler.num_preemptions
    engine.peak_blocks_in_use = engine.peak_slot_fill = 0
    engine.blocks.reset_prefix_cache()  # the timed run computes every prompt, as a first run would
    timed = run_workload(engine, requests, params)
    elapsed, produced = timed.elapsed, timed.produced
    dtype = engine.resolved.dtype
    peak = matmul_peak_gflops(jnp.dtype(dtype))

    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    flops = model_flops(engine.model_config, requests)
    figures = {
        "machine": machine.describe(),
        "workload": workload.get("name", args.workload),
        "requests": len(requests),
        "wall_s": round(elapsed, 2),
        "output_tokens": produced,
        "output_tokens_per_s": round(produced / elapsed, 1),
        "total_tokens_per_s": round((produced + prompt_tokens) / elapsed, 1),
        "model_tflop": float(f"{flops / 1e12:.3g}"),  # significant digits: a tiny model's is far below 0.01
        "matmul_peak_gflops": round(peak, 1),
        "mfu": float(f"{flops / elapsed / (peak * 1e9):.3g}"),
        "peak_kv_blocks": engine.peak_blocks_in_use,
        "kv_slot_fill_at_peak": round(engine.peak_slot_fill, 3),
        "preemptions": engine.scheduler.num_preemptions - preempt_before,
        "compiles_after_warmup": engine.runner.num_compiles - compiles_before,
        "prefix_hit_tokens": timed.prefix_hit_tokens,
        "dtype": dtype,
        "kv_cache_dtype": engine.resolved.kv_cache_dtype,
        "quantization": engine.config.quantization,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": engine.resolved.block_size,
        "kv_layout": engine.resolved.kv_layout,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.tensor_parallel_size > 1:
        engine.blocks.reset_prefix_cache()
        n = args.profile_requests
        ms, steps = collective_ms_per_step(engine, requests[:n], params[:n])
        figures |= {"collective_ms_per_step": round(ms, 2), "profiled_steps": steps}
    print(machine.one_line(figures["machine"]))
    for name, value in figures.items():
        if name != "machine":
            print(f"{name:>24}: {value}")
    if args.profile:
        figures["profile"] = step_profile.profile_run(engine, requests, params, matmul_peak=peak)
        print(step_profile.format_profile(figures["profile"]))
    if args.json:
        write_json(args.json, figures)
    return figures


def write_json(path: str | None, figures: dict) -> None:
    """The figures as JSON at path (its folder made), when one is given."""
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    host_memory.restart_with_tunables()
    main()
