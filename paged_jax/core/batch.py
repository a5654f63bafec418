"""The flat, ragged batch one engine step feeds the model, padded to its buckets on the host
(buckets.py), so a run meets a small, fixed set of shapes and nothing compiles after warm-up.
"""

import dataclasses

import jax
import numpy as np

from kernels_pallas import AttentionMetadata
from models import rope
from paged_jax.core.buckets import StepBuckets, StepShape
from paged_jax.core.scheduler import ScheduledSeq


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    input_ids: jax.Array  # int32 [num_tokens]
    positions: jax.Array  # int32 [num_tokens]
    metadata: AttentionMetadata
    logits_indices: jax.Array  # int32 [num_head_rows] row of each sequence's last new token, then 0s
    cos: jax.Array  # f32 [num_tokens, rotary_dim // 2] rope.cos_sin of the positions, made on the host
    sin: jax.Array  # f32 [num_tokens, rotary_dim // 2]


def padding_step_input(shape: StepShape, num_head_rows: int, rope_freq: np.ndarray) -> StepInput:
    """A step of padding alone (numpy arrays): no token is written (slot -1), no sequence has a length.
    What warm-up runs. rope_freq: f32 [rotary_dim // 2], the model's rotary frequencies (rope.inv_freq)."""
    return _with_rope(_padding(shape, num_head_rows), rope_freq)


def _padding(shape: StepShape, num_head_rows: int) -> StepInput:
    """padding_step_input without its rotary tables, which are made once its positions are final."""
    T, S, W, Q = shape
    metadata = AttentionMetadata(np.full(T, -1, np.int32), np.zeros((S, W), np.int32), np.zeros(S, np.int32),
                                 np.zeros(S + 1, np.int32), max_query_len=Q)
    return StepInput(np.zeros(T, np.int32), np.zeros(T, np.int32), metadata, np.zeros(num_head_rows, np.int32),
                     cos=None, sin=None)


def _with_rope(step: StepInput, rope_freq: np.ndarray) -> StepInput:
    cos, sin = rope.cos_sin(step.positions, rope_freq)
    return dataclasses.replace(step, cos=cos, sin=sin)


def build_step_input(scheduled: list[ScheduledSeq], block_size: int, buckets: StepBuckets,
                     rope_freq: np.ndarray) -> StepInput:
    """Lay the scheduled sequences' new tokens end to end, in the given order (numpy arrays)."""
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    step = _padding(buckets.shape(num_tokens, max(s.num_new_tokens for s in scheduled)), buckets.num_head_rows)
    metadata = step.metadata
    metadata.query_start_loc[:] = num_tokens
    start = 0
    for row, s in enumerate(scheduled):
        seq, n = s.seq, s.num_new_tokens
        begin = seq.num_computed_tokens
        pos = np.arange(begin, begin + n, dtype=np.int32)
        blocks = np.asarray(seq.block_ids, np.int32)
        step.input_ids[start : start + n] = seq.token_ids[begin : begin + n]
        step.positions[start : start + n] = pos
        metadata.slot_mapping[start : start + n] = blocks[pos // block_size] * block_size + pos % block_size
        metadata.block_tables[row, : len(blocks)] = blocks
        metadata.seq_lens[row] = begin + n
        metadata.query_start_loc[row] = start
        step.logits_indices[row] = start + n - 1
        start += n
    return _with_rope(step, rope_freq)
