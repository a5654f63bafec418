"""bfloat16 KV pages under float32 compute (EngineConfig.kv_cache_dtype): the C++ kernel and the XLA
path read them, widened exactly to float32, so against the reference over the same pages widened they
hold float32's tolerance, and against the unrounded float32 pages bfloat16's. Cases: both layouts,
block sizes 5 to 256, ragged lengths and query tiles, every group size the decode path is compiled for
(and one it is not), NaN in every unwritten slot."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import layout
from kernels_pallas.cpu import kernel as cpu_kernel
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.reference import paged_attention_reference
from kernels_pallas.cpu.xla import paged_attention_xla
from test_cpu_kernel import FLOAT32_CASES, PREFILL_SHAPES
from test_xla_cpu_attention import TOLERANCE, Case, case_id, make_inputs, rel_err


def _bf16_pages(inputs):
    """The inputs with their pages rounded to bfloat16, and the float32 reference over those pages."""
    q, k, v, *meta = inputs
    k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    return (q, k16, v16, *meta), (q, k16.astype(jnp.float32), v16.astype(jnp.float32), *meta)


def _check(kernel, inputs, case: Case):
    rounded, widened = _bf16_pages(inputs)
    # The case's window (blocks behind it are poisoned) and soft cap, for every side.
    options = dict(max_query_len=case.max_query_len, layout=case.layout, sliding_window=case.sliding_window,
                   soft_cap=case.soft_cap)
    out = kernel(*rounded, **options)
    exact = paged_attention_reference(*widened, **options)
    unrounded = paged_attention_reference(*inputs, **options)
    assert out.dtype == jnp.float32 and not jnp.isnan(out).any(), "a NaN from an unwritten page slot reached the output"
    assert rel_err(out, exact) < TOLERANCE[jnp.float32]  # widening loses nothing
    assert rel_err(out, unrounded) < TOLERANCE[jnp.bfloat16]  # only the pages' rounding does


_cpu = jax.jit(cpu_kernel.paged_attention_cpu, static_argnames=("max_query_len", "layout", "sliding_window", "soft_cap"))
# (group, head_dim, block_size): the decode loop of groups 1, 3 (SmolLM2), 8, over blocks of 8 to 256
# (256 beyond its bound, as 5 heads a group is: both go through the tiles), its narrow path (head_dim
# 16 over blocks of 16, the tiny model's); test_cpu_kernel.py's multi-token shapes, whose head_dim of
# 40 or 12 leaves a tail read a value at a time.
SHAPES = [(1, 64, 16), (3, 128, 128), (8, 16, 8), (5, 64, 16), (4, 64, 256), (3, 16, 16)] + PREFILL_SHAPES


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=case_id)
def test_cpu_kernel_over_bf16_pages(case):
    _check(_cpu, make_inputs(case), case)


@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
@pytest.mark.parametrize("group,head_dim,block_size", SHAPES)
def test_cpu_kernel_over_bf16_pages_of_every_shape(group, head_dim, block_size, kv_layout):
    """Decode rows (one vector loop per group size) beside rows of several tokens (register tiles,
    then head_dim's tail read a value at a time)."""
    case = Case(q_lens=(1, 37, 1, 0, 130, 1), seq_lens=(2 * block_size + 3, 37, block_size, 0, 300, 1),
                num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size, layout=kv_layout)
    _check(_cpu, make_inputs(case, seed=group), case)


@pytest.mark.parametrize("case", [c for c in FLOAT32_CASES if not c.knobs][:4], ids=case_id)
def test_xla_path_over_bf16_pages_keeps_a_float32_q(case):
    _check(jax.jit(paged_attention_xla, static_argnames=("max_query_len", "layout", "sliding_window", "soft_cap")),
           make_inputs(case), case)


def test_the_seam_takes_the_kernel_for_float32_compute_over_bf16_pages():
    assert kernels_pallas.choose_backend("auto", jnp.float32, kv_dtype=jnp.bfloat16) == (
        "cpu", "the C++ kernel for float32 over bfloat16 pages on the CPU", False)
    assert kernels_pallas.choose_backend("auto", jnp.bfloat16, kv_dtype=jnp.bfloat16).backend == "xla"
    assert kernels_pallas.choose_backend("auto", jnp.float32, kv_dtype=jnp.float16) == (
        "xla", "the CPU kernel reads float32 or bfloat16 pages, not float16", False)
    case = dataclasses.replace(FLOAT32_CASES[0], layout=layout.HEAD_MAJOR)
    rounded, widened = _bf16_pages(make_inputs(case))
    q, k, v, tables, lens, starts = rounded
    metadata = AttentionMetadata(jnp.zeros(q.shape[0], jnp.int32), tables, lens, starts, case.max_query_len)
    out = kernels_pallas.paged_attention(q, k, v, metadata, layout=case.layout)  # auto: the kernel, q kept float32
    expected = paged_attention_reference(*widened, max_query_len=case.max_query_len, layout=case.layout)
    assert out.dtype == jnp.float32 and rel_err(out, expected) < TOLERANCE[jnp.float32]


def test_mixed_or_other_page_dtypes_are_refused():
    q, k, v, *meta = make_inputs(Case(q_lens=(1, 1), seq_lens=(5, 9)))
    with pytest.raises(ValueError, match="one dtype"):
        cpu_kernel.paged_attention_cpu(q, k.astype(jnp.bfloat16), v, *meta, max_query_len=1)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernel.paged_attention_cpu(q, k.astype(jnp.float16), v.astype(jnp.float16), *meta, max_query_len=1)


@pytest.mark.parametrize("write_kv", [kernels_pallas.write_kv, layout.write_kv], ids=["seam", "xla_scatter"])
@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
def test_write_kv_rounds_to_the_nearest_bfloat16(kv_layout, write_kv):
    """As ml_dtypes rounds (to nearest, ties to even; subnormals, infinities and NaN included), into
    the slots the mapping names and nowhere else: through the seam (on the CPU, the C++ kernel writes
    them in place) as through XLA's scatter."""
    rng = np.random.default_rng(3)
    shape = layout.page_shape(4, 8, 2, 16, kv_layout)
    k = rng.standard_normal((6, 2, 16)).astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0x00008000, 0x00018000], np.uint32).view(np.float32)  # halfway cases
    k[0, 0, :8] = [*ties, 1e-40, -3e-39, np.inf, np.nan]
    slots = np.array([3, 9, -1, 31, 17, 4 * 8 + 2], np.int32)  # padding, and a slot past the pool: dropped
    pages = jnp.zeros(shape, jnp.bfloat16)
    k_pages, v_pages = write_kv(pages, pages, jnp.asarray(slots), jnp.asarray(k), jnp.asarray(-k), kv_layout)
    assert k_pages.dtype == v_pages.dtype == jnp.bfloat16
    written = (slots >= 0) & (slots < 4 * 8)
    at = layout.index(kv_layout, slots[written] // 8, slots[written] % 8, slice(None), slice(None))
    expected = k[written].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(k_pages)[at].view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(v_pages)[at].view(np.uint16),
                                  (-k[written]).astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.count_nonzero(np.asarray(k_pages, np.float32)) == np.count_nonzero(expected)
