"""The int8 CPU matmul (kernels_pallas/cpu/linear_int8.cc through cpu/kernel.py) against NumPy's float64
matmul: within the bound its activation rounding allows of the weight it packed, and within int8's
tolerance of float32, across the shapes that meet its edges (K not a multiple of 4, columns around
the 16-column panel, rows around the micro-kernel's tile) and the model's own sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import kernel as cpu_kernel
from test_cpu_linear import ROWS, SHAPES, _random


@pytest.mark.parametrize("k,n", [(1, 1), (7, 37), (576, 960)])
def test_packing_keeps_each_column_within_half_a_step(k, n):
    w = _random((k, n), 1) * np.linspace(0.01, 3, n, dtype=np.float32)  # columns of different ranges
    w[:, 0] = 0  # a zero column: scale 1, all zeros
    packed = cpu_kernel.pack_int8(jnp.asarray(w))
    assert packed.dtype == jnp.int8 and packed.shape == (-(-n // 16), -(-k // 4) + 2, 64)
    back = np.asarray(cpu_kernel.unpack_int8(packed, k, n))
    step = np.abs(w).max(axis=0) / 127
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6 * np.abs(w))  # and float32 rounding of w / step
    assert not back[:, 0].any()


@pytest.mark.parametrize("rows", ROWS)
def test_matches_float64_matmul_of_the_packed_weight_within_the_activation_rounding(rows):
    linear = jax.jit(cpu_kernel.linear_int8_cpu, static_argnames="n")
    for i, (k, n) in enumerate(SHAPES):
        x, w = _random((rows, k), i), _random((k, n), 100 + i)
        packed = cpu_kernel.pack_int8(jnp.asarray(w))
        got = np.asarray(linear(jnp.asarray(x), packed, n=n), np.float64)
        w_int8 = np.asarray(cpu_kernel.unpack_int8(packed, k, n), np.float64)
        want = x.astype(np.float64) @ w_int8
        assert got.shape == (rows, n)
        # Each x is off by at most half its row's step, a 255th of [min(x_row, 0), max(x_row, 0)];
        # float32 scaling on top.
        step = (np.maximum(x.max(axis=1, keepdims=True), 0) - np.minimum(x.min(axis=1, keepdims=True), 0)) / 255
        bound = step / 2 * (np.abs(w_int8).sum(axis=0)) * (1 + 1e-5) + 1e-5 * np.abs(want) + 1e-30
        assert np.all(np.abs(got - want) <= bound), (rows, k, n)


def test_within_int8_tolerance_of_float32_at_the_models_sizes():
    for k, n in ((576, 960), (576, 3072), (1536, 576)):
        x, w = _random((33, k), k), _random((k, n), n)
        got = np.asarray(cpu_kernel.linear_int8_cpu(jnp.asarray(x), cpu_kernel.pack_int8(jnp.asarray(w)), n))
        want = x.astype(np.float64) @ w
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1.5e-2


def test_rows_of_zeros_give_zeros_and_other_dtypes_are_refused():
    packed = cpu_kernel.pack_int8(jnp.asarray(_random((64, 40), 0)))
    assert not np.asarray(cpu_kernel.linear_int8_cpu(jnp.zeros((3, 64), jnp.float32), packed, 40)).any()
    # A row of one sign uses all 256 codes on its own range: constant rows come out exact.
    ones = np.asarray(cpu_kernel.linear_int8_cpu(jnp.full((2, 64), 3.0), packed, 40))
    np.testing.assert_allclose(ones, 3.0 * np.asarray(cpu_kernel.unpack_int8(packed, 64, 40)).sum(0)[None].repeat(2, 0),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int8"):
        cpu_kernel.linear_int8_cpu(jnp.ones((2, 64), jnp.float32), cpu_kernel.pack_columns(jnp.ones((64, 40))), 40)
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_kernel.linear_int8_cpu(jnp.ones((2, 60), jnp.float32), packed, 40))
