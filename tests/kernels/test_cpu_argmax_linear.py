"""The greedy head (kernels_pallas/cpu/linear.cc: ArgmaxLinearF32, through cpu/kernel.py) against
jnp.argmax over the C++ matmul's own product, token for token: its values are the matmul's (the same
tiles and sums), so the tokens must be identical, ties and NaN included, in the FMA kernel and, on
CPUs with AMX, the tile kernel (from 64 rows), whose threads each see part of the vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import kernel as cpu_kernel

# Rows around the FMA tile (6 or 12), the helpers' limit (24) and the tile kernel's 64 and 32-row pairs;
# columns around the 16-column panel and the 32-column work item, and the models' vocabularies' shapes.
ROWS = (1, 5, 13, 24, 25, 64, 97, 256)
SHAPES = [(64, 1), (64, 17), (17, 33), (72, 1000), (64, 8192), (576, 4099)]

linear = jax.jit(cpu_kernel.linear_cpu, static_argnames="n")
argmax_linear = jax.jit(cpu_kernel.argmax_linear_cpu, static_argnames="n")


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _both(x, w, rows=None):
    """(the greedy head's tokens, jnp.argmax of linear_cpu's product) for x f32 [M, K], w f32 [K, n]."""
    packed, n = cpu_kernel.pack_columns(jnp.asarray(w)), w.shape[1]
    rows = None if rows is None else jnp.int32(rows)
    got = np.asarray(argmax_linear(jnp.asarray(x), packed, n=n, rows=rows))
    want = np.asarray(jnp.argmax(linear(jnp.asarray(x), packed, n=n, rows=rows), axis=-1))
    assert got.dtype == np.int32 and got.shape == (x.shape[0],)
    return got, want


@pytest.mark.parametrize("tiles", (True, False))
@pytest.mark.parametrize("rows", ROWS)
def test_tokens_are_the_argmax_of_the_matmuls_product(rows, tiles):
    try:
        cpu_kernel.use_amx(tiles)
        for i, (k, n) in enumerate(SHAPES):
            got, want = _both(_random((rows, k), i), _random((k, n), 100 + i))
            np.testing.assert_array_equal(got, want, err_msg=f"{rows} x {k} x {n}")
    finally:
        cpu_kernel.use_amx(True)


@pytest.mark.parametrize("tiles", (True, False))
@pytest.mark.parametrize("rows", (3, 64, 100))
def test_ties_go_to_the_first_column(rows, tiles):
    """Columns copied from one another give equal values (each column's sums are the same in every
    lane and panel): a row's largest column copied before it, into another panel, and far after it (into
    another thread's share) must still give the first copy; a column of NaN wins from its first copy."""
    k, n = 64, 8195
    x, w = _random((rows, k), 1), _random((k, n), 2)
    try:
        cpu_kernel.use_amx(tiles)
        top = np.asarray(jnp.argmax(linear(jnp.asarray(x), cpu_kernel.pack_columns(jnp.asarray(w)), n=n), axis=-1))
        column = int(np.bincount(top).argmax())  # the most rows' largest column
        for copies in ([column - 37], [column + 1], [n - 1], [3, n - 20]):
            tied = w.copy()
            for c in copies:
                tied[:, c] = w[:, column]
            got, want = _both(x, tied)
            np.testing.assert_array_equal(got, want)
            first = min(copies + [column])
            assert np.all(got[top == column] == first), copies
        with_nan = w.copy()
        with_nan[0, [n - 5, 4000, 17]] = np.nan
        got, want = _both(x, with_nan)
        np.testing.assert_array_equal(got, want)
        assert np.all(got == 17)
    finally:
        cpu_kernel.use_amx(True)


@pytest.mark.parametrize("computed", (0, 1, 7, 70))
def test_padding_rows_get_token_zero(computed):
    """Rows past `rows` are never computed (x there may hold NaN) and get 0, the argmax of the matmul's
    zeros there; the rows before it are those of a call of them alone."""
    x, w = _random((80, 64), 3), _random((64, 300), 4)
    x[computed:] = np.nan
    got, want = _both(x, w, rows=computed)
    np.testing.assert_array_equal(got, want)
    assert not got[computed:].any()
    if computed:
        np.testing.assert_array_equal(got[:computed], _both(x[:computed], w)[0])


def test_refuses_a_column_count_that_disagrees_with_the_packing():
    packed = cpu_kernel.pack_columns(jnp.ones((4, 40), jnp.float32))
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_kernel.argmax_linear_cpu(jnp.ones((2, 4), jnp.float32), packed, 60))


@pytest.mark.parametrize("rows", (7, 70))
def test_negative_zero_and_infinite_values(rows):
    """Keys in the floats' order on either side of zero: rows all negative, a row of zeros (every column
    ties: 0), and values that overflow to -inf and +inf."""
    x, w = np.abs(_random((rows, 64), 5)), -np.abs(_random((64, 700), 6))
    x[1] = 0
    x[2] = 1e38  # -inf in every column, all tied
    x[2, 0] = 0  # (row 0 of w holds column 650's +1e38)
    x[3, 0], w[0, 650] = 1e38, 1e38  # +inf in column 650 alone
    got, want = _both(x, w)
    np.testing.assert_array_equal(got, want)
    assert got[1] == 0 and got[2] == 0 and got[3] == 650
