"""The C++ CPU matmul over packed weights (kernels_pallas/cpu/linear.cc through cpu/kernel.py) against
NumPy's float64 matmul, across the shapes that meet its tile edges: rows around the micro-kernel's
6 or 12 and, on CPUs with AMX, the tile kernel's 16 and 32 from its 64 rows up (linear_amx.h), columns
around the 16-column panel, and the model's own sizes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import kernel as cpu_kernel

ROWS = (1, 5, 6, 7, 12, 13, 64, 65, 80, 97, 131)
SHAPES = [(k, n) for k, n in itertools.product((1, 17, 64), (1, 15, 16, 17, 48, 100))] + [(576, 960), (1536, 576)]


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _assert_float32_accurate(got, x, w):
    """got against float64's x @ w: float32 sums of k products, each bounded relative to the size of a
    row's terms, not of the result."""
    k = x.shape[1]
    scale = np.abs(x).astype(np.float64) @ np.abs(w)
    assert np.all(np.abs(got - x.astype(np.float64) @ w) <= 1e-6 * k * scale + 1e-30), (x.shape, w.shape)


@pytest.mark.parametrize("rows", ROWS)
def test_matches_float64_matmul(rows):
    linear = jax.jit(cpu_kernel.linear_cpu, static_argnames="n")
    for i, (k, n) in enumerate(SHAPES):
        x, w = _random((rows, k), i), _random((k, n), 100 + i)
        got = np.asarray(linear(jnp.asarray(x), cpu_kernel.pack_columns(jnp.asarray(w)), n=n))
        assert got.shape == (rows, n)
        _assert_float32_accurate(got, x, w)


@pytest.mark.parametrize("tiles", (True, False))
def test_tile_and_fma_kernels_each_match_float64_matmul(tiles):
    """Calls of kAmxMinRows rows and more go to the tile unit where the CPU has AMX (linear_amx.h:
    six bfloat16 products of split parts), to the FMA kernel where it has not or with use_amx(False):
    either way, float32's accuracy."""
    linear = jax.jit(cpu_kernel.linear_cpu, static_argnames="n")
    try:
        cpu_kernel.use_amx(tiles)
        for rows, (k, n) in zip((64, 97, 131), [(576, 960), (1536, 576), (100, 48)]):
            x, w = _random((rows, k), rows), _random((k, n), k)
            _assert_float32_accurate(np.asarray(linear(jnp.asarray(x), cpu_kernel.pack_columns(jnp.asarray(w)), n=n)),
                                     x, w)
    finally:
        cpu_kernel.use_amx(True)


def test_packing_round_trips_and_pads_with_zeros():
    w = _random((7, 37), 0)
    packed = cpu_kernel.pack_columns(jnp.asarray(w))
    assert packed.shape == (3, 7, cpu_kernel.PANEL)
    np.testing.assert_array_equal(cpu_kernel.unpack_columns(packed, 37), w)
    assert not np.asarray(packed[-1, :, 37 - 2 * cpu_kernel.PANEL:]).any()


def test_refuses_other_dtypes():
    x = jnp.ones((2, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernel.linear_cpu(x, cpu_kernel.pack_columns(jnp.ones((4, 8), jnp.bfloat16)), 8)


def test_shapes_that_disagree_are_an_error_not_a_crash():
    packed = cpu_kernel.pack_columns(jnp.ones((4, 40), jnp.float32))
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_kernel.linear_cpu(jnp.ones((2, 5), jnp.float32), packed, 40))
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_kernel.linear_cpu(jnp.ones((2, 4), jnp.float32), packed, 60))


@pytest.mark.parametrize("rows", (1, 16, 24, 25, 64))
def test_helper_threads_and_xla_pool_give_the_same_bits(rows):
    """Calls of few rows share their work with the library's own threads, larger ones with XLA's pool
    (common.h): who computes an item must not change a bit of it."""
    x, w = _random((rows, 576), 1), _random((576, 960), 2)
    linear = jax.jit(cpu_kernel.linear_cpu, static_argnames="n")
    args = (jnp.asarray(x), cpu_kernel.pack_columns(jnp.asarray(w)))
    try:
        cpu_kernel.use_helpers(False)
        pooled = np.asarray(linear(*args, n=960))
    finally:
        cpu_kernel.use_helpers(True)
    np.testing.assert_array_equal(np.asarray(linear(*args, n=960)), pooled)
    np.testing.assert_allclose(pooled, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)


def test_concurrent_calls_share_the_helpers():
    """Calls from several threads at once (devices of one host do this): a helper busy with one call is
    passed over by the others, a posted one withdrawn if its caller finishes first; each result is
    right, and none waits for ever."""
    import concurrent.futures

    w = _random((576, 1536), 3)
    packed = cpu_kernel.pack_columns(jnp.asarray(w))
    linear = jax.jit(cpu_kernel.linear_cpu, static_argnames="n")
    xs = [_random((rows, 576), 10 + rows) for rows in (1, 3, 8, 16, 24) * 4]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: np.asarray(linear(jnp.asarray(x), packed, n=1536)), xs))
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)


def test_tiny_calls_between_sleeps():
    """Calls far shorter than a helper's waking, each after the helpers went back to sleep (300 µs of
    spinning): most are withdrawn from a helper still waking, which must then neither run a task
    that is gone nor miss the next one (a helper once took a withdrawn slot's nullptr for a task)."""
    import time

    x, w = _random((1, 16), 4), _random((16, 64), 5)
    args = (jnp.asarray(x), cpu_kernel.pack_columns(jnp.asarray(w)))
    linear = jax.jit(cpu_kernel.linear_cpu, static_argnames="n")
    want = x.astype(np.float64) @ w
    for i in range(1500):
        np.testing.assert_allclose(np.asarray(linear(*args, n=64)), want, rtol=1e-5, atol=1e-5)
        time.sleep(0.0002 * (i % 4))  # below and above the helpers' spin


@pytest.mark.parametrize("linear, pack", [(cpu_kernel.linear_cpu, cpu_kernel.pack_columns),
                                          (cpu_kernel.linear_int8_cpu, cpu_kernel.pack_int8)])
@pytest.mark.parametrize("computed", (0, 1, 7, 13, 40))
def test_rows_computes_the_leading_rows_and_zeros_the_padding(linear, pack, computed):
    """A step's matmuls take its real token count (models/llama.py): the rows before it are exactly a
    matmul of those rows alone (how many rows a call has may choose its kernel: linear.cc's tile
    kernel from kAmxMinRows rows), the padding rows after it zeros, whatever x holds there (NaN
    included)."""
    x, w = _random((40, 64), 1), _random((64, 48), 2)
    x[computed:] = np.nan
    packed = pack(jnp.asarray(w))
    run = jax.jit(linear, static_argnames="n")
    got = np.asarray(run(jnp.asarray(x), packed, n=48, rows=jnp.int32(computed)))
    if computed:
        np.testing.assert_array_equal(got[:computed], np.asarray(run(jnp.asarray(x[:computed]), packed, n=48)))
    assert not got[computed:].any()


@pytest.mark.parametrize("rows", (1, 5, 16, 30, 63, 130))
def test_lora_adds_each_rows_own_slots_delta(rows):
    """lora_cpu: out plus, for row t with slot s >= 0, in panel p's columns (x[t] @ A_s)[part p's ranks] @
    b[p, s]; rows of slot -1 and the padding rows after `rows - 1` keep out as it was. Slots of many rows
    take several row tiles and chunks (130), a slot no row names is never read (case 2); the other slots'
    B rows are not zero, so a kernel that multiplied a row by another slot's weights would be caught."""
    add = jax.jit(cpu_kernel.lora_cpu)
    for i, (k, n, slots, parts, rank) in enumerate([(576, 960, 4, 3, 16), (1536, 576, 4, 1, 16), (64, 40, 3, 2, 8),
                                                   (17, 15, 2, 3, 4)]):
        panels = -(-n // cpu_kernel.PANEL)
        out, x, a = _random((rows, n), i), _random((rows, k), 10 + i), _random((slots, k, parts * rank), 20 + i)
        packed_a = jnp.stack([cpu_kernel.pack_columns(jnp.asarray(a[s])) for s in range(slots)])
        b = _random((panels, slots, rank, cpu_kernel.PANEL), 30 + i)
        rng = np.random.default_rng(i)
        group = rng.integers(0, parts, panels).astype(np.int32)
        slot = rng.integers(-1, slots - (i == 2), rows).astype(np.int32)  # case 2: a slot unused
        computed = max(rows - 1, 1)
        got = np.asarray(add(jnp.asarray(out), jnp.asarray(x), packed_a, jnp.asarray(b), group, jnp.asarray(slot),
                             computed))
        want, scale = out.astype(np.float64), np.abs(out).astype(np.float64)
        for t in range(computed):
            if slot[t] >= 0:
                h = (x[t].astype(np.float64) @ a[slot[t]]).reshape(parts, rank)[group]  # [panels, rank]
                h_scale = (np.abs(x[t]).astype(np.float64) @ np.abs(a[slot[t]])).reshape(parts, rank)[group]
                want[t] += np.einsum("pr,prc->pc", h, b[:, slot[t]]).reshape(-1)[:n]
                scale[t] += np.einsum("pr,prc->pc", h_scale, np.abs(b[:, slot[t]])).reshape(-1)[:n]
        assert np.all(np.abs(got - want) <= 1e-6 * (k + rank + 1) * scale)
        assert np.array_equal(got[computed:], out[computed:])


def test_lora_refuses_a_slot_out_of_range():
    packed = jnp.stack([cpu_kernel.pack_columns(jnp.ones((8, 4), jnp.float32))] * 2)
    with pytest.raises(Exception, match="slot out of range"):
        jax.block_until_ready(cpu_kernel.lora_cpu(jnp.ones((3, 16), jnp.float32), jnp.ones((3, 8), jnp.float32),
                                                  packed, jnp.ones((1, 2, 4, cpu_kernel.PANEL), jnp.float32),
                                                  np.zeros(1, np.int32), jnp.asarray([0, 2, -1], jnp.int32)))
