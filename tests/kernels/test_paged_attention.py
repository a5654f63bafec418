"""The Pallas paged-attention kernel (interpret mode on the CPU) against the jnp reference, a dense
float64 oracle over contiguous K/V, and JAX's own decode kernel; plus its CUDA lowering and write_kv.
The case matrix lives in tests/kernels/kernel_matrix.py, which scripts/gpu_check.py runs on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

import kernels_pallas
from kernels_pallas import layout
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.reference import paged_attention_reference
from kernel_matrix import (CASES, PREFILL, TOLERANCE, Case, case_id, check_kernel, dense_attention,
                                    make_batch, rel_err)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernel_matches_reference_and_dense(case):
    _, problems = check_kernel(case, interpret=True)
    assert not problems


def test_bucketed_max_query_len_and_explicit_scale():
    """A bucket larger than any sequence's new tokens adds query blocks with no valid row."""
    case = Case(**PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    batch = make_batch(case, seed=1)
    out = paged_attention(*batch.args, max_query_len=64, scale=0.3, interpret=True)
    ref = paged_attention_reference(*batch.args, max_query_len=64, scale=0.3)
    assert rel_err(out, np.asarray(ref, np.float64)) < TOLERANCE[jnp.float32]
    unscaled = paged_attention_reference(*batch.args, max_query_len=64)
    assert rel_err(unscaled, np.asarray(ref, np.float64)) > 0.01, "scale must change the result"


def test_dispatch_seam_runs_the_kernel():
    # This module imported kernels_pallas.paged_attention (the kernel module) above: the package's
    # function of the same name must still be the one bound.
    assert callable(kernels_pallas.paged_attention)
    case = Case(**PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    batch = make_batch(case, seed=2)
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros(batch.q.shape[0], jnp.int32),  # unused by attention itself
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
        max_query_len=case.max_query_len,
    )
    inputs = (batch.q, batch.k_pages, batch.v_pages, metadata)
    out = kernels_pallas.paged_attention(*inputs, backend="pallas_interpret")
    ref = kernels_pallas.paged_attention(*inputs, backend="xla")
    assert rel_err(out, np.asarray(ref, np.float64)) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize(
    "case",
    [
        Case(q_lens=(1,) * 4, seq_lens=(37, 1, 100, 64), num_heads=9, num_kv_heads=3, head_dim=64,
             block_size=16),
        Case(q_lens=(1,) * 3, seq_lens=(5, 90, 33), num_heads=8, num_kv_heads=2, head_dim=128, block_size=8,
             layout=layout.HEAD_MAJOR),
    ],
    ids=case_id,
)
def test_decode_matches_jax_paged_attention(case):
    """JAX's decode kernel (pages [kv_heads, blocks, block_size, dim], heads padded to block_h=16) as an
    independent check.

    Its unwritten slots get finite garbage, not NaN: it masks scores but multiplies masked
    probabilities (0) into V, so a NaN in V would reach its output.
    """
    batch = make_batch(case, poison=1e3)
    max_blocks = batch.block_tables.shape[1]
    real = slice(0, len(case.q_lens))  # one token per sequence, without the trailing padding tokens
    theirs = jax_paged.paged_attention(
        batch.q[real] * case.head_dim**-0.5,  # it applies no softmax scale of its own
        layout.to_jax_layout(batch.k_pages, case.layout),
        layout.to_jax_layout(batch.v_pages, case.layout),
        batch.block_tables,
        batch.seq_lens,
        block_h=16,
        pages_per_compute_block=max_blocks,  # its partitions must divide the block table evenly
        k_splits=1,
        interpret=True,
    )
    out = paged_attention(*batch.args, max_query_len=1, interpret=True, layout=case.layout)
    expected = np.asarray(theirs, np.float64)
    assert rel_err(out[real], expected) < TOLERANCE[jnp.float32]
    assert rel_err(out[real], dense_attention(case, batch)[real]) < TOLERANCE[jnp.float32]


LOWERING_SHAPES = [(8, 8, 64), (9, 3, 64), (8, 2, 128), (16, 2, 128), (32, 1, 64)]  # groups 1, 3, 4, 8, 32


@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("max_query_len", [1, 7, 64])
@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=lambda s: "h{}kv{}-d{}".format(*s))
def test_lowers_to_triton_for_cuda(shape, max_query_len, dtype, kv_layout):
    """The Pallas Triton lowering (power-of-two tiles, supported ops) succeeds on this CPU machine."""
    num_heads, num_kv_heads, head_dim = shape
    num_seqs, num_blocks, block_size = 4, 32, 16
    pages = jax.ShapeDtypeStruct(layout.page_shape(num_blocks, block_size, num_kv_heads, head_dim, kv_layout), dtype)
    args = (
        jax.ShapeDtypeStruct((num_seqs * max_query_len, num_heads, head_dim), dtype),
        pages,
        pages,
        jax.ShapeDtypeStruct((num_seqs, 8), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
    )
    f = jax.jit(lambda *a: paged_attention(*a, max_query_len=max_query_len, layout=kv_layout))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("max_query_len", [1, 64])
@pytest.mark.parametrize("shape", [(8, 4, 256), (9, 3, 64)], ids=lambda s: "h{}kv{}-d{}".format(*s))
@pytest.mark.parametrize("soft_cap", [None, 50.0])
def test_sliding_window_lowers_to_triton_for_cuda(shape, max_query_len, soft_cap):
    """Gemma's sliding layers: head_dim 256 and a window (and Gemma 2's capped scores), through the
    Triton lowering."""
    num_heads, num_kv_heads, head_dim = shape
    pages = jax.ShapeDtypeStruct(layout.page_shape(32, 16, num_kv_heads, head_dim), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((4 * max_query_len, num_heads, head_dim), jnp.bfloat16), pages, pages,
            jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32),
            jax.ShapeDtypeStruct((5,), jnp.int32))
    f = jax.jit(lambda *a: paged_attention(*a, max_query_len=max_query_len, sliding_window=16, soft_cap=soft_cap))
    assert "__gpu$xla.gpu.triton" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=jnp.ones((4, 8, 96)), k_pages=jnp.ones((8, 16, 2, 96)), v_pages=jnp.ones((8, 16, 2, 96))),
         "head_dim must be a power of two"),
        (dict(q=jnp.ones((4, 7, 64))), "not a multiple of num_kv_heads"),
        (dict(v_pages=jnp.ones((8, 16, 2, 32))), "must both be"),
        (dict(k_pages=jnp.ones((8, 16, 2, 64), jnp.bfloat16)), "share a dtype"),
        (dict(seq_lens=jnp.ones(4, jnp.float32)), "seq_lens must be int32"),
        (dict(query_start_loc=jnp.zeros(4, jnp.int32)), r"query_start_loc must have shape \(5,\)"),
        (dict(block_k=8), "block_k must be a power of two >= 16"),
        (dict(block_q=2), r"block_q \* 4 \(padded group\) >= 16"),
        (dict(max_query_len=0), "max_query_len must be >= 1"),
        (dict(layout="block_major"), "kv_layout must be one of"),
        (dict(sliding_window=0), "sliding_window must be >= 1"),
        (dict(soft_cap=0.0), "soft_cap must be positive"),
    ],
)
def test_rejects_bad_arguments(change, message):
    args = dict(
        q=jnp.ones((4, 8, 64)),
        k_pages=jnp.ones((8, 16, 2, 64)),
        v_pages=jnp.ones((8, 16, 2, 64)),
        block_tables=jnp.zeros((4, 2), jnp.int32),
        seq_lens=jnp.ones(4, jnp.int32),
        query_start_loc=jnp.arange(5, dtype=jnp.int32),
        max_query_len=1,
        interpret=True,
    )
    with pytest.raises(ValueError, match=message):
        paged_attention(**{**args, **change})


@pytest.mark.parametrize("kv_layout", layout.LAYOUTS)
def test_write_kv_scatters_tokens_and_drops_padding(kv_layout):
    rng = np.random.default_rng(3)
    num_blocks, block_size, kvh, dim = 5, 4, 2, 8
    shape = layout.page_shape(num_blocks, block_size, kvh, dim, kv_layout)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    num_slots = num_blocks * block_size
    # The last slot is never a target: a -1 that wrapped around would land there.
    slots = rng.permutation(num_slots - 1)[:6]
    slot_mapping = jnp.asarray(np.insert(slots, [2, 6], -1), jnp.int32)  # padding tokens in between
    k = jnp.asarray(rng.standard_normal((len(slot_mapping), kvh, dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((len(slot_mapping), kvh, dim)), jnp.bfloat16)

    new_k, new_v = layout.write_kv(k_pages, v_pages, slot_mapping, k, v, kv_layout)

    assert new_k.dtype == k_pages.dtype and new_k.shape == k_pages.shape
    real = np.asarray(slot_mapping) >= 0
    # Token-major pages flatten to [slot, kv_head, dim]: compare there.
    slot_rows = lambda pages: np.asarray(layout.convert(pages, kv_layout, layout.TOKEN_MAJOR)).reshape(num_slots, kvh, dim)
    for new, old, src in ((new_k, k_pages, k), (new_v, v_pages, v)):
        flat_new = slot_rows(new)
        expected = slot_rows(old).copy()
        expected[slots] = np.asarray(src.astype(jnp.float32))[real]
        np.testing.assert_array_equal(flat_new, expected)
