"""Turning a batch of logits into tokens, every row with its own SamplingParams, in one jitted call.

The host packs the rows' parameters into a `SamplingTensors` pytree (`make_sampling_tensors`);
`sample` applies them as vLLM does:

1. logprobs are taken from the raw logits, before penalties and temperature (vLLM's default
   "raw_logprobs": they describe the model, not the sampler's reshaping of it), in steps where a row
   asks for them (logprobs not None); a step where none does skips the log-softmax over the
   vocabulary (a run-time branch: no second program), and as in vLLM such a request has no
   cumulative_logprob;
2. repetition, presence and frequency penalties; EOS and stop ids banned until min_tokens; then
   every token the row's constraint does not allow (structured outputs: a bitmask, all ones for an
   unconstrained row);
3. greedy rows (temperature 0) take the argmax here;
4. the other rows divide by their temperature, keep their top_k, then the smallest head of that
   whose probability reaches top_p, then drop tokens below min_p times the top probability, and
   draw with the key fold_in(PRNGKey(seed), step), so a seeded row's tokens do not depend on what
   else is in the batch.

Rows are padded to `pad_rows_to`, the bans are a bit mask over the vocabulary and the penalties'
history a fixed width, and what a batch needs within a program (top-k/top-p, logprobs) is decided at
run time by conditionals that skip the work nobody asked for. Two features choose the program instead,
through the shapes of their inputs: whether any row has penalties (a history, or none) and whether any
row draws at random (its keys, or none). A random draw's branch, never taken by a greedy batch, would
still size the program's scratch memory to several copies of the logits (88 MB at 64 rows); the CPU
runtime allocates that afresh for every call, and each page of it touched faults in again, which cost a
greedy step as much as its sampling.
"""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.core.penalties import apply_penalties
from paged_jax.core.sampling_params import MAX_LOGPROBS, SamplingParams

_BITS = 32  # tokens per word of the ban mask
# In a history, an output token the previous step sampled and the host has not read: `sample` reads it
# from that step's samples on the device (asynchronous scheduling, engine.py).
PENDING = -2


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
    key_data: jax.Array  # uint32 [R, 2]         threefry words of PRNGKey(seed); R = S if do_random, else 0
    steps: jax.Array  # int32 [S]                tokens the row has generated so far
    banned: jax.Array  # uint32 [S, W]           bit t % 32 of word t // 32: t may not be sampled this step
    history: jax.Array  # int32 [S, H]           prompt ids then output ids, -1 padded; H = 0 unless do_penalties
    pending_row: jax.Array  # int32 [S]          row of the previous step's samples that a PENDING history id is
    num_prompt_ids: jax.Array  # int32 [S]       how many of a row's history ids are its prompt's
    any_banned: jax.Array  # bool []
    do_top_k_top_p: jax.Array  # bool []         some sampled row has top_k or top_p
    any_logprobs: jax.Array  # bool []           some row asks for logprobs

    @property
    def do_penalties(self) -> bool:
        return self.history.shape[-1] > 0

    @property
    def do_random(self) -> bool:
        return self.key_data.shape[0] > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # int32 [S]
    logprobs: jax.Array  # f32 [S]             raw logprob of each chosen token; 0 unless some row asked
    top_logprobs: jax.Array  # f32 [S, K]      K = min(MAX_LOGPROBS, V), largest first; 0 unless some row asked
    top_ids: jax.Array  # int32 [S, K]


def make_sampling_tensors(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    eos_ids: Sequence[int],
    *,
    allowed: np.ndarray | None = None,
    pad_rows_to: int,
    vocab_size: int,
    history_width: int,
    pending_rows: Sequence[int] = (),
) -> SamplingTensors:
    """Pack one step's rows for `sample`.

    params, seeds, prompt_ids, output_ids: one entry per row. seeds[i] is params[i].seed, or for an
        unseeded request one the engine drew for it; any int, taken mod 2**64 as PRNGKey takes a
        64-bit seed. prompt_ids[i] / output_ids[i]: the row's prompt and generated token ids so
        far; len(output_ids[i]) is the row's step.
    eos_ids: the model's end-of-sequence ids, banned with stop_token_ids until min_tokens (unless
        ignore_eos).
    allowed: int32 [pad_rows_to, ceil(vocab_size / 32)], each row's allowed tokens as bits (structured
        outputs; None: none barred). Folded into the ban mask: a constraint adds no input and no shape.
    pad_rows_to: S, the batch bucket; rows past len(params) are greedy padding.
    vocab_size: the logits' width (at least), for the ban mask.
    history_width: H when some row has penalties, at least any row's prompt and output together (the
        engine's context length, so that it is one shape).
    pending_rows: per row, the row of the previous step's samples that holds the PENDING token at the
        end of its output_ids, if it has one (any value otherwise); none: no row has one.
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

    sampled = [p for p in params if not p.greedy]
    key_data = np.zeros((pad_rows_to if sampled else 0, 2), np.uint32)
    if sampled:
        seeds64 = [s % 2**64 for s in seeds]
        key_data[:num, 0] = [s >> 32 for s in seeds64]
        key_data[:num, 1] = [s & 0xFFFFFFFF for s in seeds64]
    banned = np.zeros((pad_rows_to, -(-vocab_size // _BITS)), np.uint32)
    for row, (p, out) in enumerate(zip(params, output_ids)):
        if len(out) >= p.min_tokens:  # nothing banned: most rows, skipped without a numpy call
            continue
        ids = np.asarray(_banned_ids(p, len(out), eos_ids), np.int64)
        ids = ids[ids < vocab_size]  # a stop id the model never produces needs no ban
        np.bitwise_or.at(banned[row], ids // _BITS, (1 << (ids % _BITS)).astype(np.uint32))
    if allowed is not None:
        if allowed.shape != banned.shape:
            raise ValueError(f"the allowed-token mask is {allowed.shape}, the ban mask {banned.shape}")
        banned |= ~allowed.view(np.uint32)
    do_penalties = any(p.uses_penalties for p in params)
    history = np.full((pad_rows_to, history_width if do_penalties else 0), -1, np.int32)
    if do_penalties:
        for row, (prompt, out) in enumerate(zip(prompt_ids, output_ids)):
            if len(prompt) + len(out) > history_width:
                raise ValueError(f"row {row} has {len(prompt) + len(out)} tokens, over history_width {history_width}")
            history[row, : len(prompt)] = prompt
            history[row, len(prompt) : len(prompt) + len(out)] = out
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
        banned=banned,
        history=history,
        num_prompt_ids=column([len(prompt) for prompt in prompt_ids], 0, np.int32),
        pending_row=column(pending_rows or 0, 0, np.int32),
        any_banned=np.bool_(banned.any()),
        do_top_k_top_p=np.bool_(any(p.top_k > 0 or p.top_p < 1 for p in sampled)),
        any_logprobs=np.bool_(any(p.logprobs is not None for p in params)),
    )


@functools.cache
def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab_size / 32)], every bit set: no token barred. Cached and read-only."""
    ones = np.full((rows, -(-vocab_size // 32)), -1, np.int32)
    ones.flags.writeable = False
    return ones


def _banned_ids(p: SamplingParams, generated: int, eos_ids: Sequence[int]) -> tuple[int, ...]:
    if generated >= p.min_tokens:
        return ()
    return p.stop_token_ids + (() if p.ignore_eos else tuple(eos_ids))


@jax.jit
def sample(logits: jax.Array, t: SamplingTensors, previous: jax.Array | None = None) -> SamplerOutput:
    """logits: float [S, V] (any float dtype, computed in f32), one row per row of `t`. previous: int32
    [P], the previous step's sampled tokens, for the PENDING ids of a history (t.pending_row).

    Compiles once per S, V, ban-mask width and history width; top logprobs are always
    min(MAX_LOGPROBS, V) wide, filled only when some row asks for them.
    """
    num_rows, vocab = logits.shape
    if num_rows != t.temperature.shape[0]:
        raise ValueError(f"logits have {num_rows} rows, the sampling tensors {t.temperature.shape[0]}")
    if t.banned.shape[1] * _BITS < vocab:
        raise ValueError(f"the ban mask covers {t.banned.shape[1] * _BITS} tokens, the logits {vocab}")
    raw = logits.astype(jnp.float32)
    logits = target_logits(raw, t, previous)
    tokens = argmax(logits)
    if t.do_random:
        tokens = jnp.where(t.temperature == 0, tokens, _random_tokens(logits, t))
    return with_logprobs(raw, tokens, t)


def target_logits(raw: jax.Array, t: SamplingTensors, previous: jax.Array | None = None) -> jax.Array:
    """raw: f32 [S, V] -> f32 [S, V], penalised and with every banned token -inf: what greedy rows
    take the argmax of and the others scale (draw_logits). previous as in `sample`."""
    logits = raw
    if t.do_penalties:
        if previous is not None:
            pending = previous[t.pending_row][:, None]
            t = dataclasses.replace(t, history=jnp.where(t.history == PENDING, pending, t.history))
        logits = apply_penalties(logits, t)
    return _ban(logits, t.banned)


def with_logprobs(raw: jax.Array, tokens: jax.Array, t: SamplingTensors) -> SamplerOutput:
    """The SamplerOutput of tokens (int32 [S]) chosen from raw (f32 [S, V]): with their raw logprobs
    and the top ones, computed only in steps where some row asks for them."""
    num_rows, vocab = raw.shape
    k = min(MAX_LOGPROBS, vocab)

    def compute():
        logprobs = jax.nn.log_softmax(raw, axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
        return jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], top_logprobs, top_ids.astype(jnp.int32)

    # The log-softmax over the vocabulary only in steps where some row asks for logprobs.
    chosen, top_logprobs, top_ids = jax.lax.cond(
        t.any_logprobs, compute,
        lambda: (jnp.zeros(num_rows, jnp.float32), jnp.zeros((num_rows, k), jnp.float32), jnp.zeros((num_rows, k), jnp.int32)))
    return SamplerOutput(tokens=tokens, logprobs=chosen, top_logprobs=top_logprobs, top_ids=top_ids)


def _ban(logits: jax.Array, banned: jax.Array) -> jax.Array:
    """logits: f32 [S, V]; banned: uint32 [S, W] bit mask -> logits with the banned tokens -inf."""
    rows, vocab = logits.shape
    bits = (banned[:, :, None] >> jnp.arange(_BITS, dtype=jnp.uint32)) & 1
    return jnp.where(bits.reshape(rows, -1)[:, :vocab] == 1, -jnp.inf, logits)


_ARGMAX_BLOCK = 512


def argmax(logits: jax.Array) -> jax.Array:
    """logits: f32 [S, V] -> int32 [S], the first index of each row's maximum, as jnp.argmax.

    XLA's CPU argmax reduces (value, index) pairs one element at a time (1.7 ms for 16 rows of
    49,152); a vectorised max over blocks first, then argmax over the block maxima and over the one
    block that holds the maximum, reads the row once at the speed of a max (0.16 ms)."""
    rows, vocab = logits.shape
    pad = -vocab % _ARGMAX_BLOCK
    blocks = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf).reshape(rows, -1, _ARGMAX_BLOCK)
    block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0], axis=-1)
    return (block * _ARGMAX_BLOCK + within).astype(jnp.int32)


def _random_tokens(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """logits: f32 [S, V], penalised -> int32 [S], a draw per row (greedy rows' are discarded)."""
    return jax.vmap(jax.random.categorical)(row_keys(t), draw_logits(logits, t)).astype(jnp.int32)


def draw_logits(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """logits: f32 [S, V], target_logits' -> f32 [S, V], what a drawing row samples from: divided by its
    temperature, then everything outside its top_k, top_p and min_p -inf."""
    scaled = logits / jnp.where(t.temperature == 0, 1.0, t.temperature)[:, None]
    scaled = jax.lax.cond(t.do_top_k_top_p, _mask_top_k_top_p, lambda x, *_: x, scaled, t.top_k, t.top_p)
    # p < min_p * p_max  <=>  logit - max_logit < log(min_p), so no softmax; min_p 0 gives -inf.
    gap = scaled - jnp.max(scaled, axis=-1, keepdims=True)
    return jnp.where(gap < jnp.log(t.min_p)[:, None], -jnp.inf, scaled)


def row_keys(t: SamplingTensors) -> jax.Array:
    """Each row's key for this step, fold_in(PRNGKey(seed), step): a seeded row's draws do not depend
    on what else is in the batch. t.do_random only."""
    keys = jax.random.wrap_key_data(t.key_data, impl="threefry2x32")
    return jax.vmap(jax.random.fold_in)(keys, t.steps)


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
