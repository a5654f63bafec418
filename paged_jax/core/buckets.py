"""Bucketing: lengths rounded up to powers of two, so a run meets a small, fixed set of shapes and
nothing compiles after warm-up.

Every array the host hands a jitted call is padded to its bucket: the step's flat batch (batch.py),
the id lists of the block pool's calls (block_manager.py) and of block copies (model_runner.py).
"""

from typing import NamedTuple

import numpy as np

# Floors of a step's buckets: smaller ones would only add compiled shapes.
MIN_TOKENS = 16
MIN_SEQS = 8
MIN_BLOCKS = 8  # block-table width


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def pad_to_bucket(ids, fill: int) -> np.ndarray:
    """int32 ids padded with `fill` to a power-of-two length, so calls compile once per size class."""
    out = np.full(bucket(len(ids)), fill, np.int32)
    out[: len(ids)] = ids
    return out


class StepShape(NamedTuple):
    """The padded sizes of one step's flat batch; each distinct value compiles the step once."""

    num_tokens: int  # T: new tokens of every sequence, end to end
    num_seqs: int  # S: rows of the block table, the sampler's rows
    max_blocks_per_seq: int  # W: block-table width
    max_query_len: int  # Q: new tokens of any one sequence; 1 for a decode-only step


def step_shape(num_tokens: int, num_seqs: int, max_blocks: int, max_new_tokens: int) -> StepShape:
    """Bucket a step of num_seqs sequences computing num_tokens new tokens in all, at most
    max_new_tokens for one sequence, whose block lists hold at most max_blocks blocks."""
    T = bucket(num_tokens, MIN_TOKENS)
    # A decode-only step keeps Q = 1: attention then takes its one-token-per-row path.
    Q = 1 if max_new_tokens == 1 else min(T, bucket(max_new_tokens, MIN_TOKENS))
    return StepShape(T, bucket(num_seqs, MIN_SEQS), bucket(max_blocks, MIN_BLOCKS), Q)
