"""oneDNN's matmul over weights in its BA16a64b layout (kernels_pallas/cpu/onednn_linear.cc through
cpu/kernel.py) against NumPy's float64 matmul, across the shapes that meet its edges: rows around the
rounding to 16 it computes, K around its blocks of 16, N around its panels of 64, and the model's own
sizes; and the engine's choice of it, measured against the C++ matmul."""

import itertools
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import kernel as cpu_kernel
from paged_jax import LLM, SamplingParams

# pyproject.toml installs the oneDNN wheels where they exist, on x86-64 Linux: there the matmul must work.
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux",
                                reason="the oneDNN wheels exist for x86-64 Linux only")

SHAPES = [(k, n) for k, n in itertools.product((1, 17, 64), (1, 63, 64, 65, 100))] + [(576, 960), (1536, 576)]


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_builds_where_the_wheels_are_installed():
    assert cpu_kernel.onednn_error() is None


@pytest.mark.parametrize("rows,real", [(1, 1), (16, 16), (20, 17), (64, 49), (131, 131), (256, 250)])
def test_matches_float64_matmul_and_zeroes_the_padding_rows(rows, real):
    linear = jax.jit(cpu_kernel.linear_onednn_cpu, static_argnames="n")
    for i, (k, n) in enumerate(SHAPES):
        x, w = _random((rows, k), i), _random((k, n), 100 + i)
        got = np.asarray(linear(jnp.asarray(x), cpu_kernel.pack_panels(jnp.asarray(w)), n=n, rows=jnp.int32(real)))
        want = x[:real].astype(np.float64) @ w
        assert got.shape == (rows, n)
        scale = np.abs(x[:real]).astype(np.float64) @ np.abs(w)
        assert np.all(np.abs(got[:real] - want) <= 1e-6 * k * scale + 1e-30), (rows, real, k, n)
        assert not got[real:].any()  # as the C++ matmul leaves a bucket's padding rows


def test_panels_are_columns_of_64_over_k_rounded_up_to_16_padded_with_zeros():
    w = _random((17, 70), 0)
    panels = np.asarray(cpu_kernel.pack_panels(jnp.asarray(w)))
    assert panels.shape == (2, 32, 64)
    np.testing.assert_array_equal(panels[1, :17, :6], w[:, 64:])
    np.testing.assert_array_equal(panels[0, :17], w[:, :64])
    assert not panels[:, 17:].any() and not panels[1, :, 6:].any()


def test_shapes_that_disagree_are_an_error_not_a_crash():
    panels = cpu_kernel.pack_panels(jnp.ones((4, 40), jnp.float32))
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_kernel.linear_onednn_cpu(jnp.ones((2, 20), jnp.float32), panels, 40))
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_kernel.linear_onednn_cpu(jnp.ones((2, 4), jnp.float32), panels, 70))


def test_min_rows_is_a_candidate_from_which_onednn_measured_faster():
    shapes, candidates = ((64, 192), (64, 64)), (64, 128, 256)
    rows = cpu_kernel.onednn_min_rows(shapes, candidates, repeats=1)
    assert rows == 0 or rows in candidates


def test_the_engine_gives_the_same_greedy_tokens_through_either_matmul(tiny_checkpoint, monkeypatch):
    """A model whose steps of 64 tokens and more multiply through oneDNN (forced here) against one on
    the C++ matmul alone: float32 both, so the same greedy tokens, from prompts long enough to use it."""
    folder, _ = tiny_checkpoint("qwen2")  # q/k/v biases added after the matmul
    prompts = [np.random.default_rng(i).integers(1, 100, 60 + 30 * i).tolist() for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    traced = []
    onednn = cpu_kernel.linear_onednn_cpu
    monkeypatch.setattr(cpu_kernel, "linear_onednn_cpu", lambda *a, **k: traced.append(1) or onednn(*a, **k))
    outputs = {}
    for rows in (0, 64):
        monkeypatch.setattr(cpu_kernel, "onednn_min_rows", lambda *a, rows=rows, **k: rows)
        llm = LLM(str(folder), max_num_batched_tokens=256, max_model_len=256, matmul_backend="cpu")
        outputs[rows] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(traced) == bool(rows)
    assert outputs[0] == outputs[64]
