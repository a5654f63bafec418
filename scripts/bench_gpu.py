"""Issue 36's figures on a lent CUDA GPU, in one command (docs/gpu.md says how to run it there).

    python scripts/bench_gpu.py                          # every part (budget: 8 minutes, compiles included)
    python scripts/bench_gpu.py --quick                  # small sizes
    python scripts/bench_gpu.py --parts llama8b,hf --model path/to/SmolLM2-folder
    python scripts/bench_gpu.py --platform cpu --quick   # the CPU, tiny models: checks this script, not a GPU

Each part prints `[PASS|FAIL|SKIP] name: figures` and its time; an exception fails its part only.
Parts, in the order they run (the 8B model's first: if time runs short, the figures the issue is
about are out):
- llama8b: Llama-3.1-8B's shape (scripts/configs/llama-3.1-8b.json) with random bfloat16 weights drawn
  on the device. The engine's model call (step_programs.step on what runner.step_args gives: its
  weights, its KV cache, the step's host arrays), on a decode batch of 64 sequences at 1,024 tokens
  of context against the HBM floor (the weights it reads and the K/V, once, at a device copy's rate),
  and on one prompt of 8,192 tokens against a bfloat16 matmul's peak, both measured in the same run.
- hf: the same weights through transformers' continuous batching (`generate_batch`) and through the
  engine (`LLM.generate`), the same greedy requests: output tok/s of each. SKIP where torch (a CUDA
  build, on a GPU) or generate_batch is missing.
- w1: W1 in bfloat16 (bench_throughput.py's workload, engine options and timed run) on --model, or
  by default a SmolLM2-shaped model with random weights (its 98 MB GGUF is more than a call carries):
  output tok/s, and a step's wall time beside its device time (the runner's device_seconds over its
  steps).
- sweep: the decode kernel's tile knobs (block_k, num_warps, num_stages, block_q) on one layer of
  SmolLM2's bfloat16 decode batch (gpu_check.py's decode-bandwidth case), each setting's K/V read rate
  as a share of a device copy's rate; PASS when every setting that compiles gives the default's output.

`--platform cpu` runs every part on the CPU with models of the same structure shrunk
(bench_gpu_models.TINY) and the Pallas kernel interpreted in the sweep.
"""

import os

# JAX takes 75% of a GPU at start-up unless told otherwise: its pool then grows only as far as the
# engine uses, and torch finds room beside it for the hf part.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_gpu_models as bench_models  # noqa: E402
import bench_throughput  # noqa: E402
import gpu_parts  # noqa: E402
import models  # noqa: E402
from gpu_parts import Result, Skip, kernel_testing, record  # noqa: E402
from kernels_pallas.paged_attention import paged_attention  # noqa: E402
from paged_jax import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from paged_jax.core import host_memory  # noqa: E402
from paged_jax.research.machine_peaks import matmul_peak_gflops  # noqa: E402

PARTS = ("llama8b", "hf", "w1", "sweep")
BLOCK_SIZE = 16
# W1's KV cache: its peak (64 sequences of up to 768 tokens, 1.1 GB for SmolLM2) with room to spare.
# The engine's default takes 90% of a GPU, which JAX's pool would keep from the parts after.
W1_KV_BYTES = 2 << 30
# Around the kernel's defaults (block_k 64, 4 warps, 2 stages; block_q 4 for SmolLM2's padded group of 4).
KNOBS = (*(dict(block_k=k, num_warps=w, num_stages=s) for k in (32, 64, 128, 256) for w in (4, 8) for s in (2, 3)),
         dict(block_q=8))
_LABELS = {"block_k": "k", "num_warps": "w", "num_stages": "s", "block_q": "q"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    w1_requests: int | None  # W1's first requests only; None: all 64
    decode: tuple[int, int]  # sequences, tokens of context each (the new one included)
    prefill: int  # tokens of one prompt, computed in one step
    hf: tuple[int, int, int]  # requests, prompt tokens, new tokens
    sweep: tuple[tuple[int, int], ...]  # (sequences, context) of each swept decode batch
    knobs: tuple[dict, ...]  # the sweep's settings, beside the default
    repeats: int  # timed calls, after a first that compiles


FULL = Sizes(None, (64, 1024), 8192, (64, 128, 128), ((64, 2048), (256, 4096)), KNOBS, 20)
QUICK = Sizes(3, (8, 128), 256, (4, 16, 8), ((2, 32), (4, 64)), (dict(block_k=32),), 2)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def host_profile(path: str, run) -> None:
    """run() once more under cProfile: its stats to path, its 25 costliest functions (own time) printed.
    A GPU's step is mostly the host's work, and this says which."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    profiler.dump_stats(path)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def part_w1(model_path: str | None, workload: str, sizes: Sizes, *, tiny: bool,
            profile_path: str | None = None, steps_per_dispatch=(1, 8)) -> list[Result]:
    """W1 as bench_throughput.py runs it (a warm-up run, then one timed LLM.generate from an empty prefix
    cache), in bfloat16; PASS when every request produced all its tokens. profile_path: then the
    one-step-a-dispatch run again under cProfile (host_profile)."""
    if model_path:
        loaded = models.load_model(model_path, dtype=jnp.bfloat16)
        model, config, tokenizer, name = loaded.model, loaded.config, loaded.tokenizer, model_path
    else:
        config = bench_models.model_config(bench_models.hf_config("smollm2-135m", tiny=tiny))
        model, tokenizer, name = bench_models.random_model(config), None, "random, SmolLM2's shape"
    _, requests, params = bench_throughput.workload_requests(
        argparse.Namespace(workload=workload, num_requests=sizes.w1_requests))
    options = bench_throughput.parse_args([])  # its engine options' defaults
    results = []
    for per_dispatch in steps_per_dispatch:  # one decode step a dispatch, and multi-step decode (multi_step.py)
        engine = LLMEngine(model, config, tokenizer, EngineConfig(
            dtype="bfloat16", max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
            kv_cache_memory_bytes=W1_KV_BYTES, num_scheduler_steps=per_dispatch))
        steps = []
        engine.runner.step_observers.append(steps.append)
        warm_up = bench_throughput.run_workload(engine, requests, params).elapsed  # compiles every shape W1 meets
        before = engine.stats()
        print(f"      (w1 steps {per_dispatch}: warm-up run {warm_up:.1f} s, {before.num_compiles} compiles)", flush=True)
        steps.clear()
        elapsed, produced = bench_throughput.run_once(engine, requests, params)
        after = engine.stats()
        device = after.device_seconds - before.device_seconds
        figures = {"model": name, "num_scheduler_steps": per_dispatch,
                   "output_tokens_per_s": round(produced / elapsed, 1), "wall_s": round(elapsed, 2),
                   "output_tokens": produced, "dispatches": len(steps), "dispatch_wall_ms": _ms(elapsed / len(steps)),
                   "dispatch_device_ms": _ms(device / len(steps)), "device_share": round(device / elapsed, 3),
                   "compiles_after_warmup": after.num_compiles - before.num_compiles, "kv_blocks": after.num_blocks}
        results.append(Result(f"w1_steps{per_dispatch}",
                              produced == sum(r["max_new_tokens"] for r in requests), figures))
        if profile_path and per_dispatch == 1:
            host_profile(profile_path, lambda: bench_throughput.run_once(engine, requests, params))
    return results


def sweep_knobs(num_seqs: int, context: int, settings, *, interpret: bool, repeats: int) -> Result:
    """Each tile setting's K/V read rate over a device copy's rate, on one layer of SmolLM2's bfloat16
    decode batch of num_seqs x context. A setting that fails to compile (more shared memory than the
    GPU has) reads n/a."""
    case = gpu_parts.smollm2_decode_case(num_seqs, context)
    batch = kernel_testing.make_batch(case, poison=0.0)
    kv_bytes = gpu_parts.kv_bytes(case)
    copy_rate = gpu_parts.copy_bandwidth(max(kv_bytes, 64 << 20), repeats)
    figures = {"kv_mb_read": round(kv_bytes / 1e6, 1), "copy_gb_per_s": gpu_parts.figure(copy_rate / 1e9)}
    expected, wrong = None, []
    for knobs in ({}, *settings):
        label = ".".join(f"{_LABELS[k]}{v}" for k, v in knobs.items()) or "default"
        attend = jax.jit(functools.partial(paged_attention, max_query_len=1, interpret=interpret, **knobs))
        try:
            out = attend(*batch.args)
            seconds = gpu_parts.timed(attend, *batch.args, repeats=repeats)
        except Exception as e:
            if not knobs:
                raise
            figures[label] = f"n/a ({type(e).__name__})"
            continue
        if expected is None:
            expected = np.asarray(out.astype(jnp.float32), np.float64)
        elif kernel_testing.rel_err(out, expected) > kernel_testing.TOLERANCE[jnp.bfloat16]:
            wrong.append(label)
        figures[label] = round(kv_bytes / seconds / copy_rate, 3)
    return Result(f"sweep {num_seqs} x {context}", not wrong, figures | ({"wrong": " ".join(wrong)} if wrong else {}))


def engine_options(sizes: Sizes) -> dict:
    """EngineConfig options of the Llama-3.1-8B engine: blocks for the largest of the parts' batches, and
    a context no longer than they need (a step's block tables and sampling history are as wide)."""
    (seqs, context), (requests, prompt, new) = sizes.decode, sizes.hf
    blocks = lambda n: -(-n // BLOCK_SIZE)
    return dict(dtype="bfloat16", block_size=BLOCK_SIZE,
                num_blocks=1 + max(seqs * blocks(context), blocks(sizes.prefill), requests * blocks(prompt + new)),
                max_model_len=max(context, sizes.prefill, prompt + new), max_num_seqs=max(seqs, requests),
                max_num_batched_tokens=max(sizes.prefill, requests * prompt))


def llama8b_engine(sizes: Sizes, *, tiny: bool):
    """(engine, model, config.json values) of Llama-3.1-8B's shape (tiny: the CPU's stand-in), its random
    bfloat16 weights drawn on the default device."""
    hf = bench_models.hf_config("llama-3.1-8b", tiny=tiny)
    config = bench_models.model_config(hf)
    model = bench_models.random_model(config)
    return LLMEngine(model, config, None, EngineConfig(**engine_options(sizes))), model, hf


def part_llama8b(built, sizes: Sizes, *, tiny: bool) -> list[Result]:
    """The model call's decode step against the HBM floor, and its prefill step against the matmul peak;
    PASS when its output is finite and no timed call compiled.
    built: () -> llama8b_engine's triple, called after the two rates are measured (their arrays freed).
    tiny: the rates measured on small arrays (the CPU's stand-in)."""
    copy_rate = gpu_parts.copy_bandwidth((64 << 20) if tiny else (2 << 30), sizes.repeats)
    peak = matmul_peak_gflops(jnp.bfloat16, **(dict(n=512, repeats=sizes.repeats) if tiny else {})) * 1e9
    engine, model, _ = built()
    c = model.config
    (seqs, context), tokens = sizes.decode, sizes.prefill
    batch = functools.partial(bench_models.scheduled_batch, vocab=c.vocab_size, block_size=BLOCK_SIZE)
    timing = bench_models.time_model_call(engine, batch(seqs, context, 1), sizes.repeats)
    weights = bench_models.weight_bytes(model)
    kv = seqs * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * jnp.dtype(jnp.bfloat16).itemsize
    floor = (weights + kv) / copy_rate
    decode = {"seqs_x_context": f"{seqs} x {context}", "step_ms": _ms(timing.median_s), "floor_ms": _ms(floor),
              "share_of_floor": round(floor / timing.median_s, 3), "weights_gb": gpu_parts.figure(weights / 1e9),
              "kv_gb": gpu_parts.figure(kv / 1e9), "copy_gb_per_s": gpu_parts.figure(copy_rate / 1e9)}
    results = [("llama-3.1-8b decode", timing, decode)]
    timing = bench_models.time_model_call(engine, batch(1, tokens, tokens), min(sizes.repeats, 5))
    # model_flops counts the one sampled row's lm_head, which the model call leaves to the sampler.
    flops = bench_throughput.model_flops(c, [dict(prompt_token_ids=[0] * tokens, max_new_tokens=1)])
    flops -= 2 * c.vocab_size * c.hidden_size
    rate = flops / timing.median_s
    prefill = {"tokens": tokens, "step_ms": _ms(timing.median_s), "tflop": gpu_parts.figure(flops / 1e12),
               "tflop_per_s": gpu_parts.figure(rate / 1e12), "matmul_peak_tflop_per_s": gpu_parts.figure(peak / 1e12),
               "share_of_peak": round(rate / peak, 3)}
    results.append(("llama-3.1-8b prefill", timing, prefill))
    return [Result(name, t.finite and not t.recompiles, figures | {"first_call_s": round(t.first_s, 1),
                                                                    "recompiles": t.recompiles})
            for name, t, figures in results]


def part_hf(built, sizes: Sizes) -> list[Result]:
    """Output tok/s of the engine and of transformers' continuous batching, each timed on a second run of
    the same greedy requests (EOS ignored); PASS when both produced every token."""
    if why := bench_models.continuous_batching_missing():
        raise Skip(why)
    engine, model, hf = built()
    num, prompt, new = sizes.hf
    prompts = np.random.default_rng(1).integers(2, model.config.vocab_size, (num, prompt)).tolist()
    requests = [dict(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)] * num
    ours_tokens = bench_throughput.run_workload(engine, requests, params).token_ids  # compiles the shapes met
    ours_s, ours_n = bench_throughput.run_once(engine, requests, params)
    hf_model = bench_models.transformers_model(model, hf)
    theirs_s, theirs_tokens, attention = bench_models.transformers_generate(
        hf_model, prompts, new, max_batch_tokens=engine.config.max_num_batched_tokens)
    theirs_n = sum(map(len, theirs_tokens))
    figures = {"requests_x_prompt_x_new": f"{num} x {prompt} x {new}", "ours_tok_per_s": round(ours_n / ours_s, 1),
               "transformers_tok_per_s": round(theirs_n / theirs_s, 1),
               "ours_over_transformers": round(ours_n / ours_s / (theirs_n / theirs_s), 2),
               "identical_requests": f"{sum(a == b for a, b in zip(ours_tokens, theirs_tokens))}/{num}",
               "transformers_attention": attention}
    return [Result("vs transformers", ours_n == theirs_n == num * new, figures)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: tiny models of the same structure, the Pallas kernel interpreted (checks this script)")
    p.add_argument("--quick", action="store_true", help="small sizes (bench_gpu.QUICK)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--model", default=None, help="W1's model (a path; default: random weights of SmolLM2's shape)")
    p.add_argument("--workload", default=str(bench_throughput.DEFAULT_WORKLOAD),
                   help="W1 by default (made from its recipe where the file is missing)")
    p.add_argument("--w1-requests", type=int, default=None, help="W1's first N requests only")
    p.add_argument("--w1-steps", default="1,8", help="w1: the decode steps a dispatch to run, comma-separated")
    p.add_argument("--host-profile", default=None, metavar="PATH",
                   help="w1: then its run once more under cProfile, the stats written to PATH")
    args = p.parse_args(argv)
    args.parts = args.parts.split(",")
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = gpu_parts.on_device(args.platform)
    except RuntimeError as e:
        print(f"[FAIL] no {args.platform} device visible to JAX ({e}); on a GPU: pip install -U 'jax[cuda13]'")
        return 1
    tiny, interpret = args.platform == "cpu", args.platform != "gpu"
    sizes = QUICK if args.quick else FULL
    if args.w1_requests:
        sizes = dataclasses.replace(sizes, w1_requests=args.w1_requests)
    print(f"jax {jax.__version__}; on {device.device_kind} ({device.platform}); parts {', '.join(args.parts)}",
          flush=True)
    built = functools.cache(lambda: llama8b_engine(sizes, tiny=tiny))  # llama8b's and hf's
    parts = {
        "w1": lambda: part_w1(args.model, args.workload, sizes, tiny=tiny, profile_path=args.host_profile,
                              steps_per_dispatch=[int(n) for n in args.w1_steps.split(",")]),
        "sweep": lambda: [sweep_knobs(n, c, sizes.knobs, interpret=interpret, repeats=sizes.repeats)
                          for n, c in sizes.sweep],
        "llama8b": lambda: part_llama8b(built, sizes, tiny=tiny),
        "hf": lambda: part_hf(built, sizes),
    }
    verdicts, start = [], time.perf_counter()
    chosen = [p for p in PARTS if p in args.parts]
    with jax.default_device(device):
        for i, name in enumerate(chosen):
            verdicts += [r.verdict for r in record(name, parts[name])]
            if not {"llama8b", "hf"} & set(chosen[i + 1:]):
                built.cache_clear()  # the 8B model's 16 GB and its KV cache, not needed after
    print(f"{verdicts.count('PASS')} passed, {verdicts.count('FAIL')} failed, {verdicts.count('SKIP')} skipped "
          f"in {time.perf_counter() - start:.0f} s")
    return 1 if "FAIL" in verdicts else 0


if __name__ == "__main__":
    host_memory.restart_with_tunables()
    sys.exit(main())
