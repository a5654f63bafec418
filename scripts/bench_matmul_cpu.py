"""The model's matmuls on the CPU: XLA's dot against the C++ matmul over packed weights
(kernels_pallas/cpu/linear.cc), alternating in one process; with --onednn, oneDNN's matmul over
its own panels (onednn_linear.cc, which the engine takes for steps of many tokens), with --int8,
the int8 matmul (linear_int8.cc), and with --fma, on a CPU with AMX, the C++ matmul with its tile
kernel off (linear_amx.h), beside them.

    python scripts/bench_matmul_cpu.py                  # SmolLM2-135M's 30 layers, float32
    python scripts/bench_matmul_cpu.py --rows 16 1024 --rounds 9 --int8 --onednn --fma

Each call runs every layer's four matmuls (fused q/k/v, o, fused gate/up, down, with SwiGLU between)
on `rows` token rows, so the weights (430 MB) stream from memory as in an engine step. Prints the
median time of each and its GFLOP/s, and each result's error against XLA's.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cpu import kernel as cpu_kernel
from paged_jax.research import machine


def _norm(x):
    # As the model's RMSNorm does: keeps 30 layers' residual sums finite, so the error means something.
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def layer_fn(hidden: int, intermediate: int, qkv: int, linear=None):
    """One layer's matmuls and what lies between them; linear(x, w, n): a C++ matmul over packed
    weights, or None for XLA's dot over plain ones."""
    linear = linear or (lambda x, w, n: x @ w)

    def layer(x, w):
        x = _norm(x)
        x = x + linear(linear(x, w["qkv"], qkv)[:, :hidden], w["o"], hidden)
        gate_up = linear(x, w["gate_up"], 2 * intermediate)
        return x + linear(jax.nn.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:], w["down"], hidden)

    return layer


def _without_amx(f):
    """f, called with the C++ matmul's tile kernel off."""
    def call(x, w):
        cpu_kernel.use_amx(False)
        try:
            return jax.block_until_ready(f(x, w))
        finally:
            cpu_kernel.use_amx(True)
    return call


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--qkv", type=int, default=960, help="fused q/k/v width")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 256, 1024])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--int8", action="store_true", help="also the int8 matmul (weights per column, rows at run time)")
    p.add_argument("--onednn", action="store_true", help="also oneDNN's matmul (float32, its BA16a64b panels)")
    p.add_argument("--fma", action="store_true",
                   help="also the C++ matmul on its FMA kernel alone, the tile unit off (where AMX is usable)")
    args = p.parse_args()
    h, i = args.hidden, args.intermediate
    rng = np.random.default_rng(0)
    shapes = dict(qkv=(h, args.qkv), o=(h, h), gate_up=(h, 2 * i), down=(i, h))
    weights = [{k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.03) for k, s in shapes.items()}
               for _ in range(args.layers)]
    packed = [{k: cpu_kernel.pack_columns(w) for k, w in layer.items()} for layer in weights]
    run = lambda linear: jax.jit(lambda x, ws: [x := layer_fn(h, i, args.qkv, linear)(x, w) for w in ws][-1])
    fns = {"xla": (run(None), weights), "packed": (run(cpu_kernel.linear_cpu), packed)}
    extras = {}  # name -> its rate's unit
    if args.onednn:
        fns["onednn"] = (run(cpu_kernel.linear_onednn_cpu),
                         [{k: cpu_kernel.pack_panels(w) for k, w in layer.items()} for layer in weights])
        extras["onednn"] = "GFLOP/s"
    if args.fma and cpu_kernel.amx_usable():
        fns["fma"] = (_without_amx(run(cpu_kernel.linear_cpu)), packed)
        extras["fma"] = "GFLOP/s"
    if args.int8:
        fns["int8"] = (run(cpu_kernel.linear_int8_cpu),
                       [{k: cpu_kernel.pack_int8(w) for k, w in layer.items()} for layer in weights])
        extras["int8"] = "GOP/s"
    flop_per_row = 2 * args.layers * sum(a * b for a, b in shapes.values())
    print(machine.one_line(machine.describe()))
    print(f"{args.layers} layers of matmuls, float32; medians of {args.rounds} alternating calls (ms)")
    print(f"{'rows':>6} {'xla':>9} {'GFLOP/s':>8} {'packed':>9} {'GFLOP/s':>8} {'speedup':>8}  rel err"
          + "".join(f" {name:>9} {unit:>8}  rel err" for name, unit in extras.items()))
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, h), np.float32) * 0.1)
        out = {name: f(x, w) for name, (f, w) in fns.items()}
        err = {name: float(jnp.linalg.norm(o - out["xla"]) / jnp.linalg.norm(out["xla"])) for name, o in out.items()}
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, (f, w) in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(f(x, w))
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
        rate = {name: flop_per_row * rows / (t / 1e3) / 1e9 for name, t in ms.items()}
        print(f"{rows:>6} {ms['xla']:9.1f} {rate['xla']:8.1f} {ms['packed']:9.1f} {rate['packed']:8.1f}"
              f" {ms['xla'] / ms['packed']:7.2f}x  {err['packed']:.1e}"
              + "".join(f" {ms[name]:9.1f} {rate[name]:8.1f}  {err[name]:.1e}" for name in extras), flush=True)


if __name__ == "__main__":
    main()
