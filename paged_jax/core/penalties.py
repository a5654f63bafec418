"""vLLM's repetition, presence and frequency penalties over a batch of logits, on the device."""

import jax
import jax.numpy as jnp


def apply_penalties(logits: jax.Array, t) -> jax.Array:
    """logits: f32 [S, V] -> f32 [S, V]; t: the step's sampling_tensors.SamplingTensors (its history
    int32 [S, H], num_prompt_ids int32 [S] and the three penalties f32 [S]).

    Repetition divides positive logits and multiplies the others of every token seen in the prompt
    or the output; presence subtracts once and frequency once per occurrence, counting the output
    only.
    """
    vocab = logits.shape[-1]
    in_output_part = jnp.arange(t.history.shape[1])[None, :] >= t.num_prompt_ids[:, None]
    output_counts = _bin_counts(jnp.where(in_output_part, t.history, -1), vocab)
    in_output = output_counts > 0
    seen = in_output | (_bin_counts(t.history, vocab) > 0)
    repetition = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * in_output


def _bin_counts(ids: jax.Array, vocab: int) -> jax.Array:
    """ids: int32 [S, L], -1 padded -> int32 [S, vocab], occurrences of each id in its row."""
    # -1 would wrap to the last token; out of range instead, for the scatter's mode="drop" to skip.
    rows, cols = jnp.arange(ids.shape[0])[:, None], jnp.where(ids < 0, vocab, ids)
    return jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, cols].add(1, mode="drop")
