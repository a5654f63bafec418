"""What attention needs to know about a flat, ragged batch of new tokens."""

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Describes one step: new tokens of several sequences laid end to end.

    Sequence i owns the new tokens query_start_loc[i]:query_start_loc[i+1] of the flat batch; they sit
    at the last q_len positions of its context of seq_lens[i] tokens (cached prefix + new tokens), so
    decode rows have q_len 1 and a prefill chunk attends causally over the prefix plus itself.
    Padding sequences have q_len 0 and seq_len 0; padding tokens have slot -1.
    """

    slot_mapping: jax.Array  # int32 [num_tokens]      physical slot of each new token, -1 = padding
    block_tables: jax.Array  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: jax.Array  # int32 [num_seqs]            context length including this step's tokens
    query_start_loc: jax.Array  # int32 [num_seqs + 1] cumulative new-token offsets, [0] = 0
    # Static upper bound on any sequence's new tokens in this step (a bucket, so shapes stay fixed).
    max_query_len: int = dataclasses.field(metadata=dict(static=True), default=1)
