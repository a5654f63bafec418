"""Bucketing: powers of two (and midpoints) with floors, and the few shapes a step can take."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

from paged_jax.core.buckets import MIN_TOKENS, StepBuckets, StepShape, bucket, fine_bucket, pad_ids


def test_bucket_is_the_next_power_of_two_above_the_floor():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    assert bucket(0) == 1 and bucket(3, minimum=16) == 16 and bucket(17, minimum=16) == 32


def test_fine_bucket_adds_the_midpoints():
    assert [fine_bucket(n) for n in range(1, 18)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]
    assert fine_bucket(48) == 48 and fine_bucket(49) == 64


def test_pad_ids_fills_the_tail():
    np.testing.assert_array_equal(pad_ids([5, 6, 7], 4, -1), [5, 6, 7, -1])
    assert pad_ids([1, 2], 8, 0).dtype == np.int32


def test_step_shape_per_backend():
    cpu = StepBuckets(max_num_batched_tokens=1024, max_num_seqs=64, max_blocks_per_seq=128, attention_backend="cpu")
    # The CPU kernel reads lengths at run time: Q is always T, the table always full width.
    assert cpu.shape(3, 1) == StepShape(MIN_TOKENS, MIN_TOKENS, 128, MIN_TOKENS)
    # T is a fine bucket there: a third of the step at most is padding.
    assert cpu.shape(42, 40) == StepShape(48, 48, 128, 48)
    assert cpu.shape(300, 100) == StepShape(384, 64, 128, 384)
    assert cpu.shape(1000, 500) == StepShape(1024, 64, 128, 1024)
    xla = StepBuckets(1024, 64, 128, "xla")
    assert xla.shape(3, 1).max_query_len == 1 and xla.shape(42, 40).max_query_len == 48
    # Powers of two for the Pallas kernel, whose every T brings a shape per Q.
    pallas = StepBuckets(1024, 64, 128, "pallas")
    assert pallas.shape(3, 1).max_query_len == 1 and pallas.shape(42, 40).num_tokens == 64
    assert pallas.shape(300, 20).max_query_len == 32 and pallas.shape(300, 257).max_query_len == 512
    with pytest.raises(ValueError, match="over max_num_batched_tokens"):
        cpu.shape(1025, 1)


@pytest.mark.parametrize("backend, count", [("cpu", 13), ("xla", 26), ("pallas", 35)])
def test_shapes_lists_every_shape_a_step_can_take(backend, count):
    buckets = StepBuckets(1024, 64, 128, backend)
    shapes = buckets.shapes()
    assert len(shapes) == len(set(shapes)) == count
    made = {buckets.shape(tokens, longest) for tokens in range(1, 1025) for longest in range(1, tokens + 1, 7)}
    made |= {buckets.shape(tokens, 1) for tokens in range(1, 65)}  # decode-only steps
    assert made == set(shapes)


def test_sample_rows_cover_every_count_up_to_max_num_seqs():
    buckets = StepBuckets(512, 50, 32, "cpu")
    rows = buckets.all_sample_rows()
    assert rows == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 50]
    for n in range(1, 51):
        assert buckets.sample_rows(n) == min(r for r in rows if r >= n)
    with pytest.raises(ValueError, match="over max_num_seqs"):
        buckets.sample_rows(51)
    # Never more rows than a step has tokens.
    assert StepBuckets(16, 64, 8, "cpu").all_sample_rows()[-1] == 16
    # The Pallas kernel's (a GPU's): powers of two, each count still covered.
    gpu = StepBuckets(512, 50, 32, "pallas")
    assert gpu.all_sample_rows() == [1, 2, 4, 8, 16, 32, 50]
    assert all(gpu.sample_rows(n) == min(r for r in gpu.all_sample_rows() if r >= n) for n in range(1, 51))


def test_few_shapes_for_any_limits():
    """130 programs at most up to 8192 tokens and 256 sequences a step; five dozen at the defaults (the
    sampler's four per row count: with or without penalties, greedy or not)."""
    for tokens, seqs, backend in itertools.product((256, 1024, 8192), (8, 64, 256), ("cpu", "xla", "pallas")):
        buckets = StepBuckets(tokens, seqs, 512, backend)
        assert len(buckets.shapes()) + 4 * len(buckets.all_sample_rows()) <= 130, (tokens, seqs, backend)
    cpu = StepBuckets(1024, 64, 128, "cpu")
    assert len(cpu.shapes()) + 4 * len(cpu.all_sample_rows()) == 13 + 48


def test_bucketing_imports_no_engine_module():
    """The data path runs one way: the scheduler, batch and block manager import this, not back."""
    code = "import sys, paged_jax.core.buckets; print(sorted(m for m in sys.modules if m.startswith('paged_jax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['paged_jax', 'paged_jax.core', 'paged_jax.core.buckets', 'paged_jax.siblings']"
