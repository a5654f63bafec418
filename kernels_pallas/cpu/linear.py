"""The CPU matmuls' Python side: x @ w over a weight packed once (packing.py), by linear.cc (float32,
FMA or the AMX tile unit; also each row's argmax of it, the greedy head), linear_int8.cc (int8
weights, activations quantized as it runs) or oneDNN (onednn_linear.cc, for steps of many rows), each
a jax.ffi call computing only a step's real rows; and the measurement that says from how many rows
oneDNN is the faster here."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cpu.library import (ARGMAX_LINEAR, LINEAR, LINEAR_INT8, LINEAR_ONEDNN, LORA, available,
                                        onednn_available, onednn_error)
from kernels_pallas.cpu.packing import pack_columns, pack_panels


def _rows_operand(x: jax.Array, rows) -> jax.Array:
    """int32 [1]: how many leading rows of x a matmul computes (all of them where rows is None)."""
    return jnp.reshape(jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32), (1,))


def linear_cpu(x: jax.Array, packed: jax.Array, n: int, rows=None) -> jax.Array:
    """x @ w for x: f32 [M, K] and packed = pack_columns(w) of a f32 w [K, n]; returns f32 [M, n].

    rows: int32 scalar, or None (M): only the leading `rows` rows of x are multiplied, the rest of
    the result is zeros. A step passes its real token count, so its bucket's padding costs nothing.
    """
    if not available():
        raise RuntimeError("the CPU kernel library could not be built; multiply with XLA")
    if x.dtype != np.float32 or packed.dtype != np.float32:
        raise ValueError(f"the CPU linear kernel takes float32, got {x.dtype} and {packed.dtype}")
    call = jax.ffi.ffi_call(LINEAR, jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))
    return call(x, packed, _rows_operand(x, rows))


def argmax_linear_cpu(x: jax.Array, packed: jax.Array, n: int, rows=None) -> jax.Array:
    """jnp.argmax(linear_cpu(x, packed, n, rows), axis=-1) as int32 [M], without the f32 [M, n] product:
    each row's running maximum is kept as the matmul's tiles are done (linear.cc: ArgmaxLinearF32), every
    value summed as linear_cpu sums it, so the tokens are the same. x: f32 [M, K]; packed: as linear_cpu's.
    Rows past `rows` get 0, the argmax of linear_cpu's zeros there."""
    if not available():
        raise RuntimeError("the CPU kernel library could not be built; multiply with XLA")
    if x.dtype != np.float32 or packed.dtype != np.float32:
        raise ValueError(f"the CPU argmax linear kernel takes float32, got {x.dtype} and {packed.dtype}")
    call = jax.ffi.ffi_call(ARGMAX_LINEAR, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, packed, _rows_operand(x, rows), n=np.int64(n))


def lora_cpu(out: jax.Array, x: jax.Array, a: jax.Array, b: jax.Array, group, slot: jax.Array,
             rows=None) -> jax.Array:
    """out plus each row's own LoRA slot's delta (lora.cc; out a base matmul's, its buffer reused): row t with
    s = slot[t] >= 0 gets, in column panel p, (x[t] @ A_s)[group[p] * r:(group[p] + 1) * r] @ b[p, s].

    out: f32 [M, n]; x: f32 [M, K]; a: f32 [S, Pa, K, PANEL], slot s's A [K, parts * r] (part-major) as
    pack_columns gives it; b: f32 [ceil(n / PANEL), S, r, PANEL]; group: int32 [ceil(n / PANEL)], each
    panel's part; slot: int32 [M] in [-1, S) (-1: none); rows: as linear_cpu's (rows after them are left
    as they are). Each slot's A and B multiply its own rows alone; a slot no row names is not read.
    """
    if not available():
        raise RuntimeError("the CPU kernel library could not be built; multiply with XLA")
    if any(v.dtype != np.float32 for v in (out, x, a, b)):
        raise ValueError(f"the CPU LoRA kernel takes float32, got {out.dtype}, {x.dtype}, {a.dtype}, {b.dtype}")
    call = jax.ffi.ffi_call(LORA, jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={0: 0})
    return call(out, x, a, b, jnp.asarray(group, jnp.int32), jnp.asarray(slot, jnp.int32), _rows_operand(out, rows))


def linear_onednn_cpu(x: jax.Array, panels: jax.Array, n: int, rows=None) -> jax.Array:
    """linear_cpu's x @ w through oneDNN (onednn_linear.cc), with panels = pack_panels(w); rows as there."""
    if not onednn_available():
        raise RuntimeError(f"the oneDNN matmul is not available: {onednn_error()}")
    if x.dtype != np.float32 or panels.dtype != np.float32:
        raise ValueError(f"the oneDNN linear kernel takes float32, got {x.dtype} and {panels.dtype}")
    call = jax.ffi.ffi_call(LINEAR_ONEDNN, jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))
    return call(x, panels, _rows_operand(x, rows))


@functools.cache
def onednn_min_rows(shapes: tuple[tuple[int, int], ...], candidates: tuple[int, ...], repeats: int = 3) -> int:
    """The fewest rows, of `candidates`, from which oneDNN multiplies x [rows, K] by every weight
    [K, N] of `shapes` (together) faster than linear_cpu, here and at every larger candidate: measured
    on this machine, each candidate's matmuls by each kernel in turn, best of `repeats`. 0 where
    oneDNN is unavailable or never faster. Measured once per process for given arguments."""
    if not onednn_available():
        return 0
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(shape, np.float32) for shape in shapes]
    kernels = ((linear_cpu, [pack_columns(jnp.asarray(w)) for w in weights]),
               (linear_onednn_cpu, [pack_panels(jnp.asarray(w)) for w in weights]))
    wins = []
    for rows in sorted(candidates):
        xs = [jnp.asarray(rng.standard_normal((rows, k), np.float32)) for k, _ in shapes]
        calls = [jax.jit(lambda xs, ws, linear=linear: [linear(x, w, n) for x, w, (_, n) in zip(xs, ws, shapes)])
                 for linear, _ in kernels]
        best = [float("inf")] * len(kernels)
        for _ in range(repeats + 1):  # the first calls compile
            for i, (call, (_, packed)) in enumerate(zip(calls, kernels)):
                start = time.perf_counter()
                jax.block_until_ready(call(xs, packed))
                best[i] = min(best[i], time.perf_counter() - start)
        wins.append((rows, best[1] < best[0]))
    smallest = 0
    for rows, won in reversed(wins):
        if not won:
            break
        smallest = rows
    return smallest


def linear_int8_cpu(x: jax.Array, packed: jax.Array, n: int, rows=None) -> jax.Array:
    """About x @ w for x: f32 [M, K] and packed = pack_int8(w) of a f32 w [K, n]; returns f32 [M, n].

    Each row of x is quantized to 8 bits as the kernel runs, its range [min(x_row, 0), max(x_row, 0)]
    in 255 steps (a scale and zero point of its own); products are summed exactly in int32
    (linear_int8.cc), so the only errors are the two roundings. rows: as linear_cpu's.
    """
    if not available():
        raise RuntimeError("the CPU kernel library could not be built; multiply with XLA")
    if x.dtype != np.float32 or packed.dtype != np.int8:
        raise ValueError(f"the int8 linear kernel takes float32 x and a pack_int8 weight, got {x.dtype} and "
                         f"{packed.dtype}")
    call = jax.ffi.ffi_call(LINEAR_INT8, jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))
    return call(x, packed, _rows_operand(x, rows))
