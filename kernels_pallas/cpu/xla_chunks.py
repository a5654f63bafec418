"""What both loops of xla.py do with a chunk of pages: gather it into contiguous K/V, KV heads first
(chunk_kv; block tables padded to whole chunks by pad_to), and fold its scores into an online softmax
(online_softmax_init, _step, _result; scores soft-capped first where the model caps them). Shapes
are the caller's: any leading rows, KV heads, then the chunk's slots."""

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas.layout import heads_first


def capped(s, soft_cap):
    """Scaled scores s, soft-capped to soft_cap * tanh(s / soft_cap) where soft_cap is set."""
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def online_softmax_init(rows_shape, head_dim):
    """(acc [*rows_shape, head_dim], running max [*rows_shape], running sum [*rows_shape]), float32."""
    return (
        jnp.zeros((*rows_shape, head_dim), jnp.float32),
        jnp.full(rows_shape, -jnp.inf, jnp.float32),
        jnp.zeros(rows_shape, jnp.float32),
    )


def online_softmax_step(carry, s, valid, v, pv_subscripts):
    """Folds one chunk into the running softmax: s [*rows, chunk] scores, valid broadcastable to s,
    v the chunk's values (masked to 0 where invalid) for `pv_subscripts` (p, v -> acc)."""
    acc, m, l = carry
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    # A row with no valid slot yet keeps m = -inf; shifting by 0 then gives exp(-inf) = 0, not NaN.
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    return alpha[..., None] * acc + jnp.einsum(pv_subscripts, p, v), m_new, alpha * l + p.sum(-1)


def online_softmax_result(carry):
    acc, _, l = carry
    return acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]


def chunk_kv(k_pages, v_pages, pages, valid, live, layout):
    """A chunk's K and V, KV heads first, in float32, V zeroed where not valid.

    k_pages, v_pages: pages in `layout`; pages: int32 [..., chunk_pages]; valid: bool [..., chunk_pages * block_size].
    returns k, v: [..., num_kv_heads, chunk_pages * block_size, head_dim].

    live: a traced bool, true wherever this is called (the chunk is within the loop's bound). 16-bit
    pages are gathered in a branch on it so that XLA cannot hoist work out of the loop: its CPU float
    normalization widens a 16-bit gather's operand, the whole page pool, to float32, and in a loop
    body that conversion is loop-invariant, so it would be hoisted and paid on every page of the pool
    at every call. Inside the branch it stays fused into the gather, per gathered element. float32
    pages skip the branch, which costs about 0.1 ms a chunk.
    """

    def fetch():
        k = heads_first(k_pages[pages], layout).astype(jnp.float32)
        v = jnp.where(valid[..., None, :, None], heads_first(v_pages[pages], layout), 0)
        return k, v.astype(jnp.float32)

    if k_pages.dtype == jnp.float32:
        return fetch()
    return lax.cond(live, fetch, lambda: jax.tree.map(jnp.zeros_like, jax.eval_shape(fetch)))


def pad_to(block_tables, multiple):
    """Block tables padded with page 0 to a whole number of chunks (the padding is masked by length)."""
    return jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % multiple)))
