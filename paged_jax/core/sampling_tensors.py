"""One step's sampling parameters as arrays: the host packs each row's SamplingParams, its bans, its
penalty history and its seed into a `SamplingTensors` pytree that `sampling.sample` applies."""

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from paged_jax.core.sampling_params import SamplingParams

BAN_BITS = 32  # tokens per word of the ban mask
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
    num_rows: jax.Array  # int32 []            rows before the padding rows, which need no logits
    any_banned: jax.Array  # bool []
    do_top_k_top_p: jax.Array  # bool []         some sampled row has top_k or top_p
    any_logprobs: jax.Array  # bool []           some row asks for logprobs

    @property
    def do_penalties(self) -> bool:
        return self.history.shape[-1] > 0

    @property
    def do_random(self) -> bool:
        return self.key_data.shape[0] > 0


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
    banned = np.zeros((pad_rows_to, -(-vocab_size // BAN_BITS)), np.uint32)
    for row, (p, out) in enumerate(zip(params, output_ids)):
        if len(out) >= p.min_tokens:  # nothing banned: most rows, skipped without a numpy call
            continue
        ids = np.asarray(_banned_ids(p, len(out), eos_ids), np.int64)
        ids = ids[ids < vocab_size]  # a stop id the model never produces needs no ban
        np.bitwise_or.at(banned[row], ids // BAN_BITS, (1 << (ids % BAN_BITS)).astype(np.uint32))
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
        num_rows=np.int32(num),
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
