"""The whole path on a CUDA GPU, in one command: kernel, engine tokens, decode bandwidth, W1 throughput.

    python scripts/gpu_check.py                # all parts (a few minutes)
    python scripts/gpu_check.py --quick        # two kernel cases and the tiny model's tokens only
    python scripts/gpu_check.py --skip-w1 --model path/to/SmolLM2.gguf

Needs JAX with its CUDA plugin (`pip install -U "jax[cuda13]"`), flax, transformers, safetensors and
gguf, with the project's code on PYTHONPATH; no torch. Each part prints PASS or FAIL with its
figures; the exit status is 1 if any part fails.

- kernel: the Pallas kernel compiled for the GPU (not interpreted) against the jnp reference and a
  float64 oracle, over the kernel test matrix (tests/kernels/kernel_matrix.py).
- tokens: greedy tokens of the engine on the GPU with the Pallas backend against the engine on the
  host CPU (its default backend), float32, on a tiny random model and on SmolLM2. Matmuls run at
  full float32 precision on both (a GPU's default may be TF32); a first difference where the CPU's
  two best tokens lie within TIE_LOGPROB of each other is reported as a near-tie, not a failure.
- decode-bandwidth: K/V bytes a decode batch's attention reads, over the kernel's time alone, beside
  a device copy's bandwidth measured in the same run; and the same batch through JAX's own Pallas
  decode kernel, compiled: the two outputs' difference and each kernel's time.
- w1: W1 in bfloat16 (scripts/bench_throughput.py): output tokens/s, model FLOP utilisation against a
  bfloat16 matmul peak measured in the same run.

`--platform cpu` runs the same parts on the CPU with the Pallas interpreter in place of the compiled
kernel (slow; the test suite runs it on small shapes): it checks this script, not a GPU.
"""

import argparse
import dataclasses
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import bench_throughput
import models
from gpu_parts import (Result, copy_bandwidth, figure, kernel_testing, kv_bytes, on_device, record,
                       smollm2_decode_case, timed)
from kernels_pallas.paged_attention import paged_attention
from models.tiny import TINY_LLAMA, random_model
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams

# A first differing token counts as a near-tie when the reference's logprobs of the two tokens are
# closer than this: float32 on two devices sums in different orders.
TIE_LOGPROB = 1e-3
SMOLLM2_PROMPTS = (
    "The capital of France is",
    "Explain what a hash table is and when to use one.",
    "def fibonacci(n):",
)


def check_kernel(cases, *, interpret: bool) -> list[Result]:
    """Each case of the kernel matrix on a random batch, on the default device."""
    results = []
    with jax.default_matmul_precision("highest"):  # the float32 reference must not run in TF32
        for case in cases:
            err, problems = kernel_testing.check_kernel(case, interpret=interpret)
            figures = {"rel_err_vs_float64": f"{err:.2e}"} | ({"failed": "; ".join(problems)} if problems else {})
            results.append(Result(f"kernel {kernel_testing.case_id(case)}", not problems, figures))
    return results


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]  # per prompt, per step: the chosen token and the runner-up


def generate_greedy(make_model: Callable, prompts, steps: int, *, device: jax.Device, **options) -> Generation:
    """Greedy tokens of an engine on `device` (made there: weights, KV cache, every step).

    make_model: () -> (model, model_config, tokenizer), called on the device. options: EngineConfig's.
    """
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=2)
    with jax.default_device(device), jax.default_matmul_precision("highest"):
        model, model_config, tokenizer = make_model()
        engine = LLMEngine(model, model_config, tokenizer, EngineConfig(dtype="float32", **options))
        outputs = LLM.from_engine(engine).generate(list(prompts), params, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    return Generation([c.token_ids for c in completions], [c.logprobs for c in completions])


def compare_tokens(name: str, checked: Generation, reference: Generation) -> Result:
    """PASS when every prompt's tokens agree, or first differ at a near-tie of the reference's."""
    same = ties = 0
    worst = None
    for ours, theirs, logprobs in zip(checked.tokens, reference.tokens, reference.logprobs):
        diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if diff is None:
            same += 1
            continue
        gap = logprobs[diff][theirs[diff]] - logprobs[diff].get(ours[diff], -np.inf)
        if gap < TIE_LOGPROB:
            ties += 1
        else:
            worst = f"token {diff}: {ours[diff]} against {theirs[diff]} (logprob gap {gap:.3g})"
    figures = {"prompts": len(reference.tokens), "identical": same, "near_ties": ties,
               "tokens_each": len(reference.tokens[0])}
    return Result(name, worst is None, figures | ({"first_real_difference": worst} if worst else {}))


def tiny_prompts(num: int, vocab: int) -> list[list[int]]:
    """Prompts of 3 to 150 tokens, every other one behind a shared 40-token prefix (prefix cache)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(2, vocab, 40).tolist()
    lengths = np.linspace(3, 110, num).astype(int)
    return [(shared if i % 2 else []) + rng.integers(2, vocab, int(n)).tolist() for i, n in enumerate(lengths)]


def check_tokens(name: str, make_model: Callable, prompts, steps: int, *, device: jax.Device, backend: str) -> Result:
    """The engine on `device` with `backend` against the engine on the CPU, in small chunks so steps
    mix prefill chunks with decodes, and with a small pool."""
    options = dict(block_size=16, num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    checked = generate_greedy(make_model, prompts, steps, device=device, attention_backend=backend, **options)
    reference = generate_greedy(make_model, prompts, steps, device=jax.devices("cpu")[0], **options)
    return compare_tokens(name, checked, reference)


def decode_bandwidth(*, interpret: bool, num_seqs: int = 64, context: int = 2048, repeats: int = 20) -> Result:
    """K/V bytes/s the kernel reaches on one layer of a bfloat16 decode batch of SmolLM2's shapes."""
    case = smollm2_decode_case(num_seqs, context)
    batch = kernel_testing.make_batch(case, poison=0.0)
    attend = jax.jit(lambda *a: paged_attention(*a, max_query_len=1, interpret=interpret))
    seconds, read = timed(attend, *batch.args, repeats=repeats), kv_bytes(case)
    kv_rate, copy_rate = read / seconds, copy_bandwidth(max(read, 64 << 20), repeats)
    figures = {"seqs_x_context": f"{num_seqs} x {context}", "kv_mb_read": round(read / 1e6, 1),
               "kernel_us": round(seconds * 1e6, 1), "kv_gb_per_s": figure(kv_rate / 1e9),
               "copy_gb_per_s": figure(copy_rate / 1e9), "share_of_copy": round(kv_rate / copy_rate, 3)}
    return Result("decode-bandwidth", True, figures)


def decode_against_jax_kernel(*, interpret: bool, num_seqs: int = 64, context: int = 2048,
                              repeats: int = 20) -> Result:
    """Our kernel against JAX's own Pallas decode kernel (jax.experimental.pallas.ops.gpu.paged_attention),
    both compiled, on one layer of a bfloat16 decode batch of SmolLM2's shapes: their outputs' relative
    difference, and each one's time. PASS when the two agree within the kernel tests' bfloat16 tolerance."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    from kernels_pallas import layout

    case = smollm2_decode_case(num_seqs, context)
    batch = kernel_testing.make_batch(case, poison=0.0)
    ours = jax.jit(lambda *a: paged_attention(*a, max_query_len=1, interpret=interpret))
    # JAX's kernel applies no softmax scale and reads head-major pages; both conversions stay untimed.
    q = batch.q[:num_seqs] * case.head_dim**-0.5
    k, v = (layout.to_jax_layout(pages, case.layout) for pages in (batch.k_pages, batch.v_pages))
    # Its K/V splits must divide the block table evenly: the table cut to the pages a context fills.
    pages = -(-context // case.block_size)
    k_splits = next(n for n in (16, 8, 4, 2, 1) if pages % n == 0)
    per_block = next(n for n in (8, 4, 2, 1) if (pages // k_splits) % n == 0)
    theirs = jax.jit(lambda *a: jax_paged.paged_attention(*a, block_h=16, pages_per_compute_block=per_block,
                                                          k_splits=k_splits, interpret=interpret))
    their_args = (q, k, v, batch.block_tables[:, :pages], batch.seq_lens)
    out, expected = ours(*batch.args)[:num_seqs], theirs(*their_args)
    err = kernel_testing.rel_err(out, np.asarray(expected.astype(jnp.float32), np.float64))
    ours_s, theirs_s = timed(ours, *batch.args, repeats=repeats), timed(theirs, *their_args, repeats=repeats)
    figures = {"rel_diff": f"{err:.2e}", "ours_us": round(ours_s * 1e6, 1), "jax_us": round(theirs_s * 1e6, 1),
               "jax_over_ours": round(theirs_s / ours_s, 3)}
    return Result("decode vs JAX's Pallas kernel", err < kernel_testing.TOLERANCE[jnp.bfloat16], figures)


def check_w1(model: str, workload: str, num_requests: int | None = None) -> Result:
    """W1 in bfloat16 through scripts/bench_throughput.py; PASS when every request produced all its
    tokens."""
    argv = ["--model", model, "--workload", workload, "--dtype", "bfloat16"]
    figures = bench_throughput.main(argv + ([] if num_requests is None else ["--num-requests", str(num_requests)]))
    requests = bench_throughput.load_workload(workload)["requests"][: figures["requests"]]
    expected = sum(r["max_new_tokens"] for r in requests)
    keep = ("output_tokens_per_s", "total_tokens_per_s", "mfu", "matmul_peak_gflops", "wall_s", "output_tokens",
            "compiles_after_warmup", "dtype")
    return Result("w1", figures["output_tokens"] == expected, {k: figures[k] for k in keep})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: the Pallas interpreter on the CPU (checks this script, not a GPU)")
    p.add_argument("--quick", action="store_true", help="two kernel cases and the tiny model's tokens only")
    p.add_argument("--skip-kernel", action="store_true")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--skip-bandwidth", action="store_true")
    p.add_argument("--skip-w1", action="store_true")
    p.add_argument("--model", default="smollm2-135m", help="SmolLM2: short name or .gguf path")
    p.add_argument("--tiny-prompts", type=int, default=6)
    p.add_argument("--steps", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--bandwidth-shape", type=int, nargs=2, default=(64, 2048), metavar=("SEQS", "CONTEXT"))
    p.add_argument("--workload", default=str(bench_throughput.DEFAULT_WORKLOAD),
                   help="W1 by default (made from its recipe where the file is missing)")
    p.add_argument("--w1-requests", type=int, default=None, help="first N requests of the workload only")
    return p.parse_args(argv)


def run(args) -> list[Result]:
    device = on_device(args.platform)
    interpret = args.platform != "gpu"
    backend = "pallas_interpret" if interpret else "pallas"
    print(f"jax {jax.__version__}; checking on {device.device_kind} ({device.platform}); "
          f"attention backend {backend!r}", flush=True)
    results = []

    def on(f, *a, **kw):
        """f(*a, **kw) with the checked device as JAX's default."""
        with jax.default_device(device):
            return f(*a, **kw)

    cases = (kernel_testing.CASES[0], kernel_testing.CASES[5]) if args.quick else kernel_testing.CASES
    if not args.skip_kernel:
        for case in cases:
            results += record(f"kernel {kernel_testing.case_id(case)}",
                              lambda c=case: on(check_kernel, [c], interpret=interpret))
    if not args.skip_tiny:
        tiny = lambda: (random_model(TINY_LLAMA), TINY_LLAMA, None)
        prompts = tiny_prompts(args.tiny_prompts, TINY_LLAMA.vocab_size)
        results += record("tokens tiny-llama", lambda: [check_tokens("tokens tiny-llama", tiny, prompts, args.steps,
                                                                     device=device, backend=backend)])
    if args.quick:
        return results
    if not args.skip_smollm2:
        smollm2 = lambda: models.load_model(args.model, dtype=jnp.float32)
        name = f"tokens {args.model}"
        results += record(name, lambda: [check_tokens(name, smollm2, SMOLLM2_PROMPTS, args.steps, device=device,
                                                      backend=backend)])
    if not args.skip_bandwidth:
        num_seqs, context = args.bandwidth_shape
        results += record("decode-bandwidth", lambda: [on(decode_bandwidth, interpret=interpret, num_seqs=num_seqs,
                                                          context=context)])
        results += record("decode vs JAX's Pallas kernel", lambda: [on(
            decode_against_jax_kernel, interpret=interpret, num_seqs=num_seqs, context=context)])
    if not args.skip_w1:
        results += record("w1", lambda: [on(check_w1, args.model, args.workload, args.w1_requests)])
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except RuntimeError as e:
        if args.platform == "gpu" and not any(d.platform == "gpu" for d in jax.devices()):
            print(f"[FAIL] no GPU visible to JAX ({e}); install its CUDA plugin: pip install -U 'jax[cuda13]'")
            return 1
        raise
    failed = [r.name for r in results if not r.ok]
    print(f"{len(results) - len(failed)} of {len(results)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
