"""Verifying drafts against the target model (Leviathan et al., 2023; vLLM's rejection_sampler.py), in
one jitted call over a step's rows, every row with its own SamplingParams as `sampling.sample` has them.

A sequence with k drafts has k + 1 rows: row i holds the target's logits after the context and the
first i drafts, and draft i + 1 (the last row has none, draft -1). Each row answers, on its own,
"if verification reaches this row, what is emitted here, and does it go on": the host then takes a
sequence's rows in order up to and including the first that does not go on (`num_accepted`).

- greedy rows (temperature 0): the draft is accepted when it is the argmax of the processed logits
  (penalties, bans); the emitted token is the argmax either way, so a rejected row emits the target's
  own token and an all-accepted sequence's last row its bonus token;
- drawing rows: the proposers here are deterministic (q is one-hot on the draft), so min(1, p/q) is
  p(draft) under the row's processed distribution (temperature, top-k/p, min-p after penalties and
  bans): accepted when u < p(draft); on rejection the token is drawn from max(0, p - q), renormalised:
  p with the draft's mass removed. P(emit x) = p(x) for every x. The residual draw uses the row's
  key as `sample` would, so a row without a draft draws exactly what `sample` draws for it; the
  acceptance test a key folded from it.

Logprobs are those of the emitted tokens (sampling.with_logprobs), from the raw logits.
"""

import jax
import jax.numpy as jnp

from paged_jax.core import sampling
from paged_jax.core.sampling import SamplerOutput
from paged_jax.core.sampling_tensors import SamplingTensors


@jax.jit
def rejection_sample(logits: jax.Array, t: SamplingTensors, drafts: jax.Array,
                     previous: jax.Array | None = None) -> tuple[SamplerOutput, jax.Array]:
    """logits: float [S, V], one row per row of t (a row's steps, history and bans already those of
    its position: the drafts before it counted as output); drafts: int32 [S], the draft each row
    verifies, -1 for none; previous as in sampling.sample.

    Returns the SamplerOutput of each row's emitted token, and bool [S]: whether its draft is accepted
    (False where it has none)."""
    raw = logits.astype(jnp.float32)
    processed = sampling.target_logits(raw, t, previous)
    greedy = sampling.argmax(processed)
    has_draft = drafts >= 0
    safe = jnp.maximum(drafts, 0)[:, None]
    accepted = has_draft & (greedy == drafts)
    tokens = greedy
    if t.do_random:
        scaled = sampling.draw_logits(processed, t)
        p_draft = jnp.take_along_axis(jax.nn.softmax(scaled, axis=-1), safe, axis=-1)[:, 0]
        keys = sampling.row_keys(t)
        u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
        drawn_accepts = has_draft & (u < p_draft)
        is_draft = (jnp.arange(scaled.shape[1])[None, :] == safe) & has_draft[:, None]
        residual = jnp.where(is_draft, -jnp.inf, scaled)
        # A draft holding all the mass is always accepted; its residual (all -inf) is never used.
        residual = jnp.where(jnp.isfinite(residual).any(axis=-1, keepdims=True), residual, scaled)
        drawn = sampling.draw(keys, residual)
        sampled_rows = t.temperature > 0
        accepted = jnp.where(sampled_rows, drawn_accepts, accepted)
        tokens = jnp.where(sampled_rows, jnp.where(drawn_accepts, drafts, drawn), greedy)
    return sampling.with_logprobs(raw, tokens, t), accepted


def num_accepted(accepted, start: int, num_drafts: int) -> int:
    """accepted: bool [S] on the host; a sequence's drafts verified in rows start .. start + num_drafts
    -> how many of them are accepted (its first num_accepted + 1 rows' tokens are emitted)."""
    n = 0
    while n < num_drafts and accepted[start + n]:
        n += 1
    return n
