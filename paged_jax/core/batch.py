"""The flat, ragged batch one engine step feeds the model, padded to its buckets on the host
(buckets.py), so a run meets a small, fixed set of shapes and nothing compiles after warm-up.

A token the previous step sampled but the host has not read yet (asynchronous scheduling: the engine
runs one step ahead, engine.py) goes in as a placeholder: `token_src` names the row of the previous
step's sampled tokens that the model call takes its id from, on the device.
"""

import dataclasses
import itertools

import jax
import numpy as np

from kernels_pallas import AttentionMetadata
from models import rope
from models.lora import LoRARows
from paged_jax.core.buckets import StepBuckets, StepShape
from paged_jax.core.scheduler_output import ScheduledSeq


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInput:
    input_ids: jax.Array  # int32 [num_tokens]
    token_src: jax.Array  # int32 [num_tokens] row of the previous step's samples holding the id, or -1
    positions: jax.Array  # int32 [num_tokens]
    metadata: AttentionMetadata
    logits_indices: jax.Array  # int32 [num_head_rows] row of each sequence's last new token, then 0s
    cos: jax.Array  # f32 [num_tokens, rotary_dim // 2] rope.cos_sin of the positions, made on the host
    sin: jax.Array  # f32 [num_tokens, rotary_dim // 2]
    # Which LoRA adapter each row runs with (models.lora.LoRARows, adapters.with_lora_rows); None without LoRA.
    lora_rows: LoRARows | None = None


def padding_step_input(shape: StepShape, num_head_rows: int, rope_freq: np.ndarray) -> StepInput:
    """A step of padding alone (numpy arrays): no token is written (slot -1), no sequence has a length.
    What warm-up runs. rope_freq: f32 [rotary_dim // 2], the model's rotary frequencies (rope.inv_freq)."""
    return _with_rope(_padding(shape, num_head_rows), rope_freq)


def _padding(shape: StepShape, num_head_rows: int) -> StepInput:
    """padding_step_input without its rotary tables, which are made once its positions are final."""
    T, S, W, Q = shape
    metadata = AttentionMetadata(np.full(T, -1, np.int32), np.zeros((S, W), np.int32), np.zeros(S, np.int32),
                                 np.zeros(S + 1, np.int32), max_query_len=Q)
    return StepInput(np.zeros(T, np.int32), np.full(T, -1, np.int32), np.zeros(T, np.int32), metadata,
                     np.zeros(num_head_rows, np.int32), cos=None, sin=None)


def _with_rope(step: StepInput, rope_freq: np.ndarray) -> StepInput:
    cos, sin = rope.cos_sin(step.positions, rope_freq)
    return dataclasses.replace(step, cos=cos, sin=sin)


def build_step_input(scheduled: list[ScheduledSeq], block_size: int, buckets: StepBuckets,
                     rope_freq: np.ndarray) -> StepInput:
    """Lay the scheduled sequences' new tokens end to end, in the given order (numpy arrays).

    A sequence's last pending token (a decode row's one new token, or the last of a prompt chunk's,
    which then has no other pending token) is taken on the device from row seq.sample_row of the
    previous dispatch's samples (its last step's, after several: multi_step.py). A decode row (one new token, most rows of most steps) is laid out in
    plain Python, a prompt chunk with numpy: a numpy call costs about a microsecond whatever its size.
    """
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    step = _padding(buckets.shape(num_tokens, max(s.num_new_tokens for s in scheduled)), buckets.num_head_rows)
    metadata = step.metadata
    rows = len(scheduled)
    ids, src, positions, slots, seq_lens, starts = [], [], [], [], [], []
    # Every row's page table in one pass: the rows' block ids end to end, into a mask of their lengths.
    lengths = np.fromiter((len(s.seq.block_ids) for s in scheduled), np.int32, rows)
    every_block = np.fromiter(itertools.chain.from_iterable(s.seq.block_ids for s in scheduled), np.int32,
                              lengths.sum())
    metadata.block_tables[:rows][np.arange(metadata.block_tables.shape[1]) < lengths[:, None]] = every_block
    start = 0
    for s in scheduled:
        seq, n = s.seq, s.num_new_tokens
        # A sequence's drafts follow its tokens (speculative decoding), none pending beside them.
        tokens = seq.token_ids + seq.draft_ids if seq.draft_ids else seq.token_ids
        begin, known, blocks = seq.num_computed_tokens, len(tokens), seq.block_ids
        starts.append(start)
        seq_lens.append(begin + n)
        if n == 1:
            ids.append(tokens[begin] if begin < known else 0)
            src.append(-1 if begin < known else seq.sample_row)
            positions.append(begin)
            slots.append(blocks[begin // block_size] * block_size + begin % block_size)
        else:
            pos = np.arange(begin, begin + n, dtype=np.int32)
            ids.extend(tokens[begin : begin + n])
            src.extend([-1] * min(n, known - begin))
            if begin + n > known:  # the pending token, last
                ids.append(0)
                src.append(seq.sample_row)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(blocks, np.int32)[pos // block_size] * block_size + pos % block_size).tolist())
        start += n
    step.input_ids[:num_tokens] = ids
    step.token_src[:num_tokens] = src
    step.positions[:num_tokens] = positions
    metadata.slot_mapping[:num_tokens] = slots
    metadata.seq_lens[:rows] = seq_lens
    metadata.query_start_loc[:rows] = starts
    metadata.query_start_loc[rows:] = num_tokens
    step.logits_indices[:rows] = np.asarray(starts[1:] + [num_tokens]) - 1
    return _with_rope(step, rope_freq)
