"""Plain-jnp paged attention: the reference every kernel is tested against."""

import jax
import jax.numpy as jnp

from kernels_pallas.layout import TOKEN_MAJOR, gather_kv, page_dims


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    layout: str = TOKEN_MAJOR,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of ragged new tokens over their sequences' paged K/V.

    q: [num_tokens, num_heads, head_dim]; query heads h*G..h*G+G-1 share KV head h (G = group size).
    k_pages, v_pages: pages in `layout` (layout.py: [num_blocks, block_size, num_kv_heads, head_dim]
        token-major, [num_blocks, num_kv_heads, block_size, head_dim] head-major), already holding
        this step's new K/V.
    block_tables: int32 [num_seqs, max_blocks_per_seq]
    seq_lens: int32 [num_seqs]; 0 for padding sequences.
    query_start_loc: int32 [num_seqs + 1]
    max_query_len: static bound on new tokens per sequence.
    sliding_window: static; a query at position p sees only keys at positions > p - sliding_window
        (None: the whole context).
    soft_cap: static; each scaled score s becomes soft_cap * tanh(s / soft_cap) (Gemma 2), or None.
    returns [num_tokens, num_heads, head_dim] in q's dtype; rows of padding tokens are 0.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = page_dims(k_pages, layout)[2]
    group = num_heads // num_kv_heads
    num_seqs = block_tables.shape[0]
    scale = head_dim**-0.5 if scale is None else scale

    k = gather_kv(k_pages, block_tables, layout).astype(jnp.float32)  # [S, K, KVH, D]
    v = gather_kv(v_pages, block_tables, layout).astype(jnp.float32)
    kv_pos = jnp.arange(k.shape[1])
    kv_valid = kv_pos[None, :] < seq_lens[:, None]  # [S, K]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    if sliding_window is not None:  # nothing before the first new token's window is read
        kv_valid &= kv_pos[None, :] > (seq_lens - q_lens)[:, None] - sliding_window
    # Unwritten slots, and slots the window has left, may hold anything (NaN included): mask values,
    # not just scores.
    v = jnp.where(kv_valid[:, :, None, None], v, 0.0)

    qi = jnp.arange(max_query_len)
    q_valid = qi[None, :] < q_lens[:, None]  # [S, Q]
    q_idx = jnp.where(q_valid, query_start_loc[:-1, None] + qi[None, :], num_tokens)  # [S, Q]
    qs = q.astype(jnp.float32).at[q_idx].get(mode="fill", fill_value=0.0)  # [S, Q, H, D]
    qs = qs.reshape(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    q_pos = seq_lens[:, None] - q_lens[:, None] + qi[None, :]  # [S, Q]

    mask = kv_valid[:, None, :] & (kv_pos[None, None, :] <= q_pos[:, :, None]) & q_valid[:, :, None]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.einsum("sqhgd,skhd->shgqk", qs, k) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None], jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("shgqk,skhd->sqhgd", p, v).reshape(num_seqs, max_query_len, num_heads, head_dim)
    return jnp.zeros((num_tokens, num_heads, head_dim), q.dtype).at[q_idx].set(out.astype(q.dtype), mode="drop")
