"""The C++ CPU kernel (kernels_pallas/cpu/attention.cc through cpu/kernel.py) against the jnp reference,
on the same NaN-poisoned, permuted, ragged cases as the XLA path, and the seam's choice of it."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import layout
from kernels_pallas.cpu import kernel as cpu_kernel
from kernels_pallas.cpu import library
from kernels_pallas.reference import paged_attention_reference
from test_xla_cpu_attention import CASES, TOLERANCE, TRAILING_PAD_TOKENS, Case, case_id, make_inputs, rel_err

FLOAT32_CASES = [c for c in CASES if c.dtype == jnp.float32]


def test_builds_on_this_machine():
    assert cpu_kernel.available()


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=case_id)
def test_matches_reference(case):
    inputs = make_inputs(case)
    kernel = jax.jit(cpu_kernel.paged_attention_cpu,
                     static_argnames=("max_query_len", "layout", "sliding_window", "soft_cap"))
    out = kernel(*inputs, max_query_len=case.max_query_len, layout=case.layout, sliding_window=case.sliding_window,
                 soft_cap=case.soft_cap)
    ref = paged_attention_reference(*inputs, max_query_len=case.max_query_len, layout=case.layout,
                                    sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    assert not jnp.isnan(out).any(), "a NaN from an unwritten page slot reached the output"
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]
    assert not np.asarray(out[-TRAILING_PAD_TOKENS:]).any(), "tokens of no sequence must be 0"


# The decode path is compiled per group size (1, 2, 3, 4, 6, 8) for head_dim a multiple of the vector
# width and blocks of up to 128 slots; head_dim 16 over blocks of 16 or 64 (AVX-512's one vector, the
# tiny model's shape) takes the narrow path, which transposes K and keeps every score; other shapes go
# through the general tile (5 heads a group, head_dim 40, blocks of 256).
DECODE_SHAPES = [(g, d, bs) for g in (1, 2, 3, 4, 5, 6, 8) for d, bs in ((64, 16), (16, 8), (16, 16))] + [
    (3, 128, 128), (2, 40, 16), (4, 64, 256), (3, 16, 64)]


@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
@pytest.mark.parametrize("group,head_dim,block_size", DECODE_SHAPES)
def test_decode_rows_of_every_group_size(group, head_dim, block_size, kv_layout):
    case = Case(q_lens=(1, 1, 1, 0, 1), seq_lens=(1, 2 * block_size + 3, block_size, 0, 300), num_heads=2 * group,
                num_kv_heads=2, head_dim=head_dim, block_size=block_size, layout=kv_layout)
    inputs = make_inputs(case, seed=group)
    out = cpu_kernel.paged_attention_cpu(*inputs, max_query_len=1, layout=kv_layout)
    ref = paged_attention_reference(*inputs, max_query_len=1, layout=kv_layout)
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]


def test_long_contexts_and_many_query_tiles():
    rng = np.random.default_rng(7)
    decodes = tuple(int(n) for n in rng.integers(1, 400, 19))
    case = Case(q_lens=(1,) * 19 + (70, 130, 3), seq_lens=decodes + (70, 350, 203), block_size=8)
    inputs = make_inputs(case, seed=7)
    out = cpu_kernel.paged_attention_cpu(*inputs, max_query_len=case.max_query_len, scale=0.2)
    ref = paged_attention_reference(*inputs, max_query_len=case.max_query_len, scale=0.2)
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]


def test_refuses_other_dtypes():
    inputs = make_inputs(Case(q_lens=(1, 1), seq_lens=(5, 9), dtype=jnp.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernel.paged_attention_cpu(*inputs, max_query_len=1)


def test_seam_picks_the_kernel_for_float32_on_the_cpu():
    assert kernels_pallas.default_backend(jnp.float32) == "cpu"
    assert kernels_pallas.default_backend(jnp.bfloat16) == "xla"
    assert kernels_pallas.choose_backend("auto", jnp.float32) == ("cpu", "the C++ kernel for float32 on the CPU", False)
    assert kernels_pallas.choose_backend("auto", jnp.bfloat16) == (
        "xla", "the CPU kernel takes float32, not bfloat16", False)
    assert kernels_pallas.choose_backend("xla", jnp.float32) == ("xla", "asked for", False)


def test_kernel_without_its_source_is_a_fallback_that_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(library, "_SOURCES", (tmp_path / "attention.cc", *library._SOURCES[1:]))
    library.build_error.cache_clear()
    try:
        assert kernels_pallas.choose_backend("auto", jnp.float32) == (
            "xla", "the CPU kernel is unavailable: its source attention.cc is not installed beside kernels_pallas/cpu/library.py",
            True)
    finally:
        monkeypatch.undo()
        library.build_error.cache_clear()
        assert cpu_kernel.available()


def test_bad_block_table_is_an_error_not_a_crash():
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc = make_inputs(Case(q_lens=(1, 1), seq_lens=(5, 9)))
    block_tables = block_tables.at[1, 0].set(k_pages.shape[0] + 5)
    with pytest.raises(Exception, match="outside the page pool"):
        jax.block_until_ready(cpu_kernel.paged_attention_cpu(
            q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, max_query_len=1))


def _call_kernel(inputs, kv_layout, **attributes):
    """The kernel's FFI call, with `attributes` replacing the ones the layout gives."""
    call = jax.ffi.ffi_call(library.ATTENTION, jax.ShapeDtypeStruct(inputs[0].shape, inputs[0].dtype))
    return call(*inputs, scale=np.float32(inputs[0].shape[-1] ** -0.5), sliding_window=np.int64(0),
                soft_cap=np.float32(0.0),
                **cpu_kernel.layout_attributes(inputs[1], kv_layout) | attributes)


# Rows of several new tokens go through register tiles of 2 vectors, then 1, then scalars along
# head_dim (64, 40 and 12 reach each), query tiles of 96 / group rows padded to whole register tiles,
# and key chunks of 64 positions cut across blocks of any size; the causal diagonal falls inside
# and across chunks.
PREFILL_SHAPES = [(3, 64, 16), (1, 64, 8), (5, 40, 16), (7, 12, 5), (4, 128, 128), (2, 16, 32)]


@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
@pytest.mark.parametrize("group,head_dim,block_size", PREFILL_SHAPES)
def test_multi_token_rows_of_every_shape(group, head_dim, block_size, kv_layout):
    case = Case(q_lens=(1, 37, 5, 0, 130, 64, 65), seq_lens=(50, 37, 20, 0, 300, 64, 129), num_heads=2 * group,
                num_kv_heads=2, head_dim=head_dim, block_size=block_size, layout=kv_layout)
    inputs = make_inputs(case, seed=group)
    out = cpu_kernel.paged_attention_cpu(*inputs, max_query_len=case.max_query_len, layout=kv_layout)
    ref = paged_attention_reference(*inputs, max_query_len=case.max_query_len, layout=kv_layout)
    assert not jnp.isnan(out).any(), "a NaN from an unwritten page slot reached the output"
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("window,soft_cap", [(1, None), (5, None), (16, None), (64, None), (200, None), (None, 2.0),
                                             (16, 2.0)])
@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
@pytest.mark.parametrize("head_dim,block_size", [(256, 16), (64, 8), (40, 16), (16, 16)])
def test_sliding_windows_and_soft_caps_on_every_path(window, soft_cap, kv_layout, head_dim, block_size):
    """Decode rows (AttendDecode; AttendRows for head_dim 40) and query tiles (AttendRows), windows of
    one key, inside a page, of a whole key chunk, and past the context, blocks behind them poisoned;
    Gemma 2's soft-capped scores (a cap of 2 bends most of them)."""
    case = Case(q_lens=(1, 1, 37, 0, 130, 1, 65), seq_lens=(300, 3, 37, 0, 300, 64, 129), num_heads=4,
                num_kv_heads=2, head_dim=head_dim, block_size=block_size, layout=kv_layout, sliding_window=window,
                soft_cap=soft_cap)
    inputs = make_inputs(case, seed=window or 0)
    out = cpu_kernel.paged_attention_cpu(*inputs, max_query_len=case.max_query_len, layout=kv_layout,
                                         sliding_window=window, soft_cap=soft_cap)
    ref = paged_attention_reference(*inputs, max_query_len=case.max_query_len, layout=kv_layout,
                                    sliding_window=window, soft_cap=soft_cap)
    assert not jnp.isnan(out).any(), "a NaN from a slot behind the window reached the output"
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]


def test_strides_past_a_block_are_an_error_not_a_crash():
    """Head-major strides over token-major pages would read past the last block."""
    inputs = make_inputs(Case(q_lens=(1, 1), seq_lens=(5, 9)))
    head_major_strides = cpu_kernel.layout_attributes(layout.convert(inputs[1], layout.TOKEN_MAJOR, layout.HEAD_MAJOR),
                                                      layout.HEAD_MAJOR)
    with pytest.raises(Exception, match="strides do not match"):
        jax.block_until_ready(_call_kernel(inputs, layout.TOKEN_MAJOR, head_stride=head_major_strides["head_stride"]))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_unwritten_pages_take_no_memory_until_written():
    shape = (8192, 16, 8, 64)  # 256 MiB of float32
    before = _resident_bytes()
    pages = jax.block_until_ready(cpu_kernel.unwritten(shape, jnp.float32))
    assert pages.shape == shape and pages.dtype == jnp.float32
    assert _resident_bytes() - before < 64 << 20
    pages = jax.jit(lambda p: p.at[3].set(1.0), donate_argnums=0)(pages)  # updated in place, like the KV cache
    assert float(pages[3].sum()) == 16 * 8 * 64


def test_loading_the_kernel_leaves_subnormal_arithmetic_alone():
    # Linked with -ffast-math, a shared library sets flush-to-zero for the whole process when loaded.
    check = ("import numpy as np; from kernels_pallas.cpu import kernel as cpu_kernel; assert cpu_kernel.available(); "
             "tiny = np.finfo(np.float32).smallest_subnormal; print(float(tiny * np.float32(1.0)) > 0)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
