"""Bucketing: powers of two with floors, and the step's padded shape."""

import subprocess
import sys

import numpy as np

from paged_jax.core.buckets import MIN_BLOCKS, MIN_SEQS, MIN_TOKENS, StepShape, bucket, pad_to_bucket, step_shape


def test_bucket_is_the_next_power_of_two_above_the_floor():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]
    assert bucket(0) == 1 and bucket(3, minimum=16) == 16 and bucket(17, minimum=16) == 32


def test_pad_to_bucket_fills_the_tail():
    np.testing.assert_array_equal(pad_to_bucket([5, 6, 7], -1), [5, 6, 7, -1])
    assert pad_to_bucket([1, 2], 0).dtype == np.int32


def test_step_shape():
    # Decode-only: one new token per sequence keeps max_query_len 1.
    assert step_shape(3, 3, 2, 1) == StepShape(MIN_TOKENS, MIN_SEQS, MIN_BLOCKS, 1)
    # A 40-token prompt beside two decodes: Q is bucketed, never past T.
    assert step_shape(42, 3, 9, 40) == StepShape(64, 8, 16, 64)
    assert step_shape(20, 1, 2, 20) == StepShape(32, 8, 8, 32)


def test_bucketing_imports_no_engine_module():
    """The data path runs one way: the scheduler, batch and block manager import this, not back."""
    code = "import sys, paged_jax.core.buckets; print(sorted(m for m in sys.modules if m.startswith('paged_jax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['paged_jax', 'paged_jax.core.buckets']"
