"""The flat, ragged batch one engine step feeds the model, padded to its buckets on the host
(buckets.py), so a run meets a small, fixed set of shapes and nothing compiles after warm-up.
"""

import dataclasses

import jax
import numpy as np

from kernels_pallas import AttentionMetadata
from paged_jax.core.buckets import step_shape
from paged_jax.core.scheduler import ScheduledSeq


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    input_ids: jax.Array  # int32 [num_tokens]
    positions: jax.Array  # int32 [num_tokens]
    metadata: AttentionMetadata
    logits_indices: jax.Array  # int32 [num_seqs] row of each sequence's last new token


def build_step_input(scheduled: list[ScheduledSeq], block_size: int) -> StepInput:
    """Lay the scheduled sequences' new tokens end to end, in the given order (numpy arrays)."""
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    T, S, W, Q = step_shape(num_tokens, len(scheduled), max(len(s.seq.block_ids) for s in scheduled),
                            max(s.num_new_tokens for s in scheduled))

    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    block_tables = np.zeros((S, W), np.int32)
    seq_lens = np.zeros(S, np.int32)
    query_start_loc = np.full(S + 1, num_tokens, np.int32)
    logits_indices = np.zeros(S, np.int32)

    start = 0
    for row, s in enumerate(scheduled):
        seq, n = s.seq, s.num_new_tokens
        begin = seq.num_computed_tokens
        pos = np.arange(begin, begin + n, dtype=np.int32)
        blocks = np.asarray(seq.block_ids, np.int32)
        input_ids[start : start + n] = seq.token_ids[begin : begin + n]
        positions[start : start + n] = pos
        slot_mapping[start : start + n] = blocks[pos // block_size] * block_size + pos % block_size
        block_tables[row, : len(blocks)] = blocks
        seq_lens[row] = begin + n
        query_start_loc[row] = start
        logits_indices[row] = start + n - 1
        start += n
    metadata = AttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len=Q)
    return StepInput(input_ids, positions, metadata, logits_indices)
