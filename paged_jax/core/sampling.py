"""Turning a batch of logits into tokens, every row with its own SamplingParams, in one jitted call.

The host packs the rows' parameters into a `SamplingTensors` pytree (sampling_tensors.py);
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
history a fixed width, and what a batch needs within a program (top-k/top-p, logprobs, a greedy
program's bans) is decided at run time by conditionals that skip the work nobody asked for. Two
features choose the program instead, through the shapes of their inputs: whether any row has
penalties (a history, or none) and whether any row draws at random (its keys, or none). A random
draw's branch, never taken by a greedy batch, would still size the program's scratch memory to
several copies of the logits (88 MB at 64 rows); the CPU runtime allocates that afresh for every call,
and each page of it touched faults in again, which cost a greedy step as much as its sampling.
"""

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.core.penalties import apply_penalties
from paged_jax.core.sampling_params import MAX_LOGPROBS
from paged_jax.core.sampling_tensors import BAN_BITS, PENDING, SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: jax.Array  # int32 [S]
    logprobs: jax.Array  # f32 [S]             raw logprob of each chosen token; 0 unless some row asked
    top_logprobs: jax.Array  # f32 [S, K]      K = min(MAX_LOGPROBS, V), largest first; 0 unless some row asked
    top_ids: jax.Array  # int32 [S, K]


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
    if t.banned.shape[1] * BAN_BITS < vocab:
        raise ValueError(f"the ban mask covers {t.banned.shape[1] * BAN_BITS} tokens, the logits {vocab}")
    raw = logits.astype(jnp.float32)
    if t.do_random:
        logits = target_logits(raw, t, previous)
        tokens = jnp.where(t.temperature == 0, argmax(logits), _random_tokens(logits, t))
    else:
        # The bans only in steps where some row has one: spelling the bit mask out over the vocabulary
        # cost a greedy step of 64 rows of Gemma 3's 262,144 logits about 45 ms, the argmax 4.
        penalised = penalised_logits(raw, t, previous)
        tokens = jax.lax.cond(t.any_banned, lambda: argmax(_ban(penalised, t.banned)), lambda: argmax(penalised))
    return with_logprobs(raw, tokens, t)


def sample_head(head, x: jax.Array, t: SamplingTensors, previous: jax.Array | None = None) -> SamplerOutput:
    """`sample` of head.logits(x, t.num_rows) (a model's: f32 [S, V] from x [S, hidden]). Where
    head.greedy_head, the tokens of a step that needs nothing of the logits but their argmax (every row
    greedy and no penalties, a program chosen by the tensors' shapes; no bans and no logprobs, decided at
    run time) are head.greedy_tokens(x, t.num_rows) instead, the same tokens without the logits: over 256
    rows of 8,192 the argmax read back the 8 MB that the lm_head had just written, a tenth of the tiny
    model's decode step. previous as in `sample`."""
    whole = lambda: sample(head.logits(x, t.num_rows), t, previous)
    if not head.greedy_head or t.do_random or t.do_penalties:
        return whole()

    def greedy():
        blank = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(whole))
        return dataclasses.replace(blank, tokens=head.greedy_tokens(x, t.num_rows))

    return jax.lax.cond(t.any_banned | t.any_logprobs, whole, greedy)


def target_logits(raw: jax.Array, t: SamplingTensors, previous: jax.Array | None = None) -> jax.Array:
    """raw: f32 [S, V] -> f32 [S, V], penalised and with every banned token -inf: what greedy rows
    take the argmax of and the others scale (draw_logits). previous as in `sample`."""
    return _ban(penalised_logits(raw, t, previous), t.banned)


def penalised_logits(raw: jax.Array, t: SamplingTensors, previous: jax.Array | None = None) -> jax.Array:
    """raw: f32 [S, V] -> f32 [S, V] with the rows' penalties applied (raw itself where no row has
    any: a program chosen by the history's shape). previous as in `sample`."""
    if not t.do_penalties:
        return raw
    if previous is not None:
        pending = previous[t.pending_row][:, None]
        t = dataclasses.replace(t, history=jnp.where(t.history == PENDING, pending, t.history))
    return apply_penalties(raw, t)


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
    bits = (banned[:, :, None] >> jnp.arange(BAN_BITS, dtype=jnp.uint32)) & 1
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
    return draw(row_keys(t), draw_logits(logits, t))


def draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """keys: [S] PRNG keys; logits: f32 [S, V], -inf for a barred token -> int32 [S], each row's token drawn
    from softmax(logits) by inverting its running sum at one uniform number. jax.random.categorical's
    Gumbel noise is a random number per token: 118 ms for 64 rows of 49,152 on a 2-core Xeon, this 16."""
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    u = jax.vmap(jax.random.uniform)(keys)
    token = jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1)
    # u * total may round up to the total: then the last token with mass, never one past it.
    last = p.shape[-1] - 1 - jnp.argmax(p[:, ::-1] > 0, axis=-1)
    return jnp.minimum(token, last).astype(jnp.int32)


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

    Both cut-offs are found by bisection over the logits' values (32 masked passes each, a branch skipped
    where no row asks for it), not by sorting the vocabulary: XLA's sort of 64 rows of 49,152 logits
    takes about a second on a 2-core Xeon. The top_p cut-off is the smallest value whose strictly larger
    values hold less than top_p of the mass: the value at which a sorted running sum would stop.
    """
    vocab = logits.shape[-1]
    keys = _ordered_bits(logits)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    # The k-th largest value: the smallest t with fewer than k values above it.
    above = lambda t: keys > t[:, None]
    kth = jax.lax.cond(jnp.any(top_k > 0), lambda: _smallest(lambda t: jnp.sum(above(t), axis=-1) < k, keys),
                       lambda: jnp.min(keys, axis=-1))
    probs = jax.nn.softmax(jnp.where(keys >= kth[:, None], logits, -jnp.inf), axis=-1)
    cut = jax.lax.cond(jnp.any(top_p < 1), lambda: _smallest(
        lambda t: jnp.sum(jnp.where(above(t), probs, 0), axis=-1) < top_p, keys), lambda: kth)
    # top_p 1 keeps everything even where rounding lets the mass reach 1 early.
    cut = jnp.where(top_p >= 1, kth, jnp.maximum(cut, kth))
    return jnp.where(keys < cut[:, None], -jnp.inf, logits)


def _ordered_bits(x: jax.Array) -> jax.Array:
    """f32 [...] -> uint32 [...] in the floats' order (-inf lowest; -0 and +0 one value)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _smallest(holds, keys: jax.Array) -> jax.Array:
    """uint32 [S]: per row, the smallest t in [min, max] of keys (uint32 [S, V]) where holds(t) (bool [S])
    is true, for a holds that is false below some t and true from there up, true at the max."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)))[1]
