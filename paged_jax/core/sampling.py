"""Turning a batch of logits into tokens, every row with its own SamplingParams, in one jitted call.

The host packs the rows' parameters into a `SamplingTensors` pytree (`make_sampling_tensors`);
`sample` applies them as vLLM does:

1. logprobs are taken from the raw logits, before penalties and temperature (vLLM's default
   "raw_logprobs": they describe the model, not the sampler's reshaping of it), in steps where a row
   asks for them (logprobs not None); a step where none does skips the log-softmax over the
   vocabulary, and its chosen-token logprobs are NaN (as in vLLM, such a request has no
   cumulative_logprob);
2. repetition, presence and frequency penalties; EOS and stop ids banned until min_tokens;
3. greedy rows (temperature 0) take the argmax here;
4. the other rows divide by their temperature, keep their top_k, then the smallest head of that
   whose probability reaches top_p, then drop tokens below min_p times the top probability, and
   draw with the key fold_in(PRNGKey(seed), step), so a seeded row's tokens do not depend on what
   else is in the batch.

Shapes are bucketed (rows padded to `pad_rows_to`, id lists to powers of two) and the few choices
that change the computation are static fields of the pytree, so one compiled program serves every
batch of a bucket and an all-greedy batch pays for no sort and no random draw.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.core.sampling_params import MAX_LOGPROBS, SamplingParams

_STATIC = dict(static=True)
# Smallest padded widths, so that lists that grow by a token a step rarely change the bucket.
_MIN_HISTORY_WIDTH = 32
_MIN_BANNED_WIDTH = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """One step's sampling parameters, a row per sequence (S rows, padding rows included).

    Built as numpy arrays on the host; `sample` moves them to the device in its one call.
    """

    temperature: jax.Array  # f32 [S]            0 = greedy
    top_k: jax.Array  # int32 [S]                0 = off
    top_p: jax.Array  # f32 [S]                  1 = off
    min_p: jax.Array  # f32 [S]                  0 = off
    repetition_penalty: jax.Array  # f32 [S]     1 = off
    presence_penalty: jax.Array  # f32 [S]       0 = off
    frequency_penalty: jax.Array  # f32 [S]      0 = off
    key_data: jax.Array  # uint32 [S, 2]         threefry words of PRNGKey(seed)
    steps: jax.Array  # int32 [S]                tokens the row has generated so far
    banned_ids: jax.Array  # int32 [S, B]        ids the row may not sample this step, -1 padded
    prompt_ids: jax.Array  # int32 [S, P]        -1 padded; P = 0 unless do_penalties
    output_ids: jax.Array  # int32 [S, O]        -1 padded; O = 0 unless do_penalties
    all_greedy: bool = dataclasses.field(metadata=_STATIC, default=True)
    do_top_k_top_p: bool = dataclasses.field(metadata=_STATIC, default=False)
    do_penalties: bool = dataclasses.field(metadata=_STATIC, default=False)
    # 0: no row asks for logprobs, and none are computed; MAX_LOGPROBS (capped at the vocabulary):
    # every row's are, rows asking for fewer slice their share. Two variants of each program.
    num_top_logprobs: int = dataclasses.field(metadata=_STATIC, default=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # int32 [S]
    logprobs: jax.Array  # f32 [S]             raw logprob of each chosen token; NaN unless num_top_logprobs
    top_logprobs: jax.Array  # f32 [S, K]      K = the tensors' num_top_logprobs, largest first
    top_ids: jax.Array  # int32 [S, K]


def make_sampling_tensors(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    eos_ids: Sequence[int],
    *,
    pad_rows_to: int,
) -> SamplingTensors:
    """Pack one step's rows for `sample`.

    params, seeds, prompt_ids, output_ids: one entry per row. seeds[i] is params[i].seed, or for an
        unseeded request one the engine drew for it; any int, taken mod 2**64 as PRNGKey takes a
        64-bit seed. prompt_ids[i] / output_ids[i]: the row's prompt and generated token ids so
        far; len(output_ids[i]) is the row's step.
    eos_ids: the model's end-of-sequence ids, banned with stop_token_ids until min_tokens (unless
        ignore_eos).
    pad_rows_to: S, the batch bucket; rows past len(params) are greedy padding.
    """
    num = len(params)
    if not len(seeds) == len(prompt_ids) == len(output_ids) == num:
        raise ValueError(
            f"one seed, prompt and output per row: got {num} params, {len(seeds)} seeds, "
            f"{len(prompt_ids)} prompts, {len(output_ids)} outputs"
        )
    if pad_rows_to < num:
        raise ValueError(f"pad_rows_to ({pad_rows_to}) is smaller than the batch ({num} rows)")

    def column(values, fill, dtype):
        out = np.full(pad_rows_to, fill, dtype)
        out[:num] = values
        return out

    seeds64 = [s % 2**64 for s in seeds]
    key_data = np.zeros((pad_rows_to, 2), np.uint32)
    key_data[:num, 0] = [s >> 32 for s in seeds64]
    key_data[:num, 1] = [s & 0xFFFFFFFF for s in seeds64]
    banned = [_banned_ids(p, len(out), eos_ids) for p, out in zip(params, output_ids)]
    sampled = [p for p in params if not p.greedy]
    do_penalties = any(p.uses_penalties for p in params)
    if do_penalties:
        prompts = _pad_ids(prompt_ids, pad_rows_to, _MIN_HISTORY_WIDTH)
        outputs = _pad_ids(output_ids, pad_rows_to, _MIN_HISTORY_WIDTH)
    else:
        prompts = outputs = np.full((pad_rows_to, 0), -1, np.int32)
    return SamplingTensors(
        temperature=column([0.0 if p.greedy else p.temperature for p in params], 0.0, np.float32),
        top_k=column([max(p.top_k, 0) for p in params], 0, np.int32),
        top_p=column([p.top_p for p in params], 1.0, np.float32),
        min_p=column([p.min_p for p in params], 0.0, np.float32),
        repetition_penalty=column([p.repetition_penalty for p in params], 1.0, np.float32),
        presence_penalty=column([p.presence_penalty for p in params], 0.0, np.float32),
        frequency_penalty=column([p.frequency_penalty for p in params], 0.0, np.float32),
        key_data=key_data,
        steps=column([len(out) for out in output_ids], 0, np.int32),
        banned_ids=_pad_ids(banned, pad_rows_to, _MIN_BANNED_WIDTH),
        prompt_ids=prompts,
        output_ids=outputs,
        all_greedy=not sampled,
        do_top_k_top_p=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
        do_penalties=do_penalties,
        num_top_logprobs=MAX_LOGPROBS if any(p.logprobs is not None for p in params) else 0,
    )


def _banned_ids(p: SamplingParams, generated: int, eos_ids: Sequence[int]) -> tuple[int, ...]:
    if generated >= p.min_tokens:
        return ()
    return p.stop_token_ids + (() if p.ignore_eos else tuple(eos_ids))


def _pad_ids(rows: Sequence[Sequence[int]], num_rows: int, min_width: int) -> np.ndarray:
    """int32 [num_rows, W]: row i holds rows[i] then -1; W is a power of two, at least min_width."""
    longest = max(map(len, rows), default=0)
    width = max(min_width, 1 << max(longest - 1, 0).bit_length())
    out = np.full((num_rows, width), -1, np.int32)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


@jax.jit
def sample(logits: jax.Array, t: SamplingTensors) -> SamplerOutput:
    """logits: float [S, V] (any float dtype, computed in f32), one row per row of `t`.

    Recompiles only when S, V, the padded widths of `t` or its static flags change.
    """
    num_rows = t.temperature.shape[0]
    if logits.shape[0] != num_rows:
        raise ValueError(f"logits have {logits.shape[0]} rows, the sampling tensors {num_rows}")
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1) if t.num_top_logprobs else None
    if t.do_penalties:
        logits = apply_penalties(logits, t)
    rows, cols = _scatter_index(t.banned_ids, logits.shape[-1])
    logits = logits.at[rows, cols].set(-jnp.inf, mode="drop")
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not t.all_greedy:
        tokens = jnp.where(t.temperature == 0, tokens, _random_tokens(logits, t))
    if logprobs is None:
        nothing = jnp.zeros((num_rows, 0))
        return SamplerOutput(tokens, jnp.full(num_rows, jnp.nan), nothing, nothing.astype(jnp.int32))
    top_logprobs, top_ids = jax.lax.top_k(logprobs, min(t.num_top_logprobs, logits.shape[-1]))
    return SamplerOutput(
        tokens=tokens,
        logprobs=jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0],
        top_logprobs=top_logprobs,
        top_ids=top_ids.astype(jnp.int32),
    )


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """vLLM's penalties. logits: f32 [S, V] -> f32 [S, V].

    Repetition divides positive logits and multiplies the others of every token seen in the prompt
    or the output; presence subtracts once and frequency once per occurrence, counting the output
    only.
    """
    vocab = logits.shape[-1]
    output_counts = _bin_counts(t.output_ids, vocab)
    in_output = output_counts > 0
    seen = in_output | (_bin_counts(t.prompt_ids, vocab) > 0)
    repetition = jnp.where(seen, t.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - t.frequency_penalty[:, None] * output_counts
    return logits - t.presence_penalty[:, None] * in_output


def _bin_counts(ids: jax.Array, vocab: int) -> jax.Array:
    """ids: int32 [S, L], -1 padded -> int32 [S, vocab], occurrences of each id in its row."""
    rows, cols = _scatter_index(ids, vocab)
    return jnp.zeros((ids.shape[0], vocab), jnp.int32).at[rows, cols].add(1, mode="drop")


def _scatter_index(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices into [S, vocab] for ids: int32 [S, L], -1 padded."""
    # -1 would wrap to the last token; out of range instead, for the scatter's mode="drop" to skip.
    return jnp.arange(ids.shape[0])[:, None], jnp.where(ids < 0, vocab, ids)


def _random_tokens(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """logits: f32 [S, V], penalised -> int32 [S], a draw per row (greedy rows' are discarded)."""
    scaled = logits / jnp.where(t.temperature == 0, 1.0, t.temperature)[:, None]
    if t.do_top_k_top_p:
        scaled = _mask_top_k_top_p(scaled, t.top_k, t.top_p)
    # p < min_p * p_max  <=>  logit - max_logit < log(min_p), so no softmax; min_p 0 gives -inf.
    gap = scaled - jnp.max(scaled, axis=-1, keepdims=True)
    scaled = jnp.where(gap < jnp.log(t.min_p)[:, None], -jnp.inf, scaled)
    keys = jax.random.wrap_key_data(t.key_data, impl="threefry2x32")
    keys = jax.vmap(jax.random.fold_in)(keys, t.steps)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def _mask_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits: f32 [S, V]; top_k: int32 [S], 0 = off; top_p: f32 [S] -> logits with the rest -inf.

    Keeps the top_k largest, then the fewest of those whose probability, renormalised over the
    top_k, reaches top_p (vLLM's order). Ties with the smallest kept logit are kept too.
    """
    vocab = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_top_k = jnp.arange(vocab) < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p 1 keeps everything even where rounding lets the running sum reach 1 early.
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    # keep is a prefix of the sorted row (mass_before only grows), so its length finds the cut-off.
    cutoff = jnp.take_along_axis(desc, keep.sum(axis=-1, keepdims=True) - 1, axis=-1)
    return jnp.where(logits < cutoff, -jnp.inf, logits)
