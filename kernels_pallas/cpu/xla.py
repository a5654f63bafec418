"""Paged attention for the CPU: plain XLA loops that read K/V a chunk of pages at a time.

Computes exactly what `reference.paged_attention_reference` computes (same signature plus tuning
knobs; masking conventions in metadata.py). The reference gathers every sequence's whole bucketed
block table into contiguous K/V and attends over max_query_len query slots per sequence; on the CPU
that costs tens of milliseconds a layer, most of it moving padding. Here the work follows the real
tokens instead:

- Rows with one new token (decode rows, wherever they sit in the batch) are sorted by context
  length and taken `decode_group` at a time. A group walks its K/V in chunks of
  `decode_chunk_pages` pages with an online softmax, for as many chunks as its longest row needs (a
  dynamic trip count, so a wide bucketed block table and short rows cost nothing). Sorting puts rows
  of similar length together, so few chunks are spent on rows that have already ended.
- Rows with more new tokens are cut into query tiles of `prefill_tile` tokens. A tile attends to its
  sequence's K/V in chunks of `prefill_chunk_pages` pages, again with an online softmax, and stops at
  its last query's causal bound. The tile count is dynamic too: it follows the real new tokens, not
  the padded batch.

Pages may be in either layout (layout.py): a chunk's gather reads whole pages and `layout.heads_first`
puts them in the [kv_heads, tokens, head_dim] order the dots want, one transposing copy either way.

Rows are told apart by their token counts at run time, so any batch takes the fast path for each
row; the caller need not order or flag them.

A sliding window (a query at position p sees keys at positions > p - window) moves where each loop
starts: a decode group at the chunk of its earliest row's first visible key, a tile at the chunk of its
first token's. Keys before the window are masked as keys past the end are, V zeroed, so pages the
window has left behind may hold anything.

Why the shapes are what they are (measured on 2 AVX-512 cores; see scripts/bench_attention_cpu.py):
XLA cannot fuse a gather into a dot, so each chunk's pages are copied into a small buffer that the
dots then read from cache. That copy runs at 5-15 GB/s on pages in random order, well under a
streaming read, and is most of the cost of decode; the dots for decode are matrix-vector shaped (G
query heads per KV head) and run far below peak. About two thousand tokens per chunk step (16 rows x
8 pages) keeps the loop's fixed costs small; chunk sizes from 512 to 4096 tokens measured the same
within the machine's noise. Prefill tiles give the dots tile * G rows (768 at the defaults), which
XLA runs at over 100 GFLOP/s.

NaN-safety: K/V slots past a sequence's length may hold anything. Scores of masked slots are replaced
(never multiplied) by -inf and masked V slots by 0, so 0 * NaN never happens; rows of padding tokens
stay 0. Softmax runs in float32 whatever the dtype of q and the pages.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import cdiv

from kernels_pallas.cpu.xla_chunks import (capped, chunk_kv, online_softmax_init, online_softmax_result,
                                            online_softmax_step, pad_to)
from kernels_pallas.layout import TOKEN_MAJOR, page_dims


def paged_attention_xla(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    decode_group: int = 16,
    decode_chunk_pages: int = 8,
    prefill_tile: int = 256,
    prefill_chunk_pages: int = 16,
    layout: str = TOKEN_MAJOR,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of ragged new tokens over their sequences' paged K/V, for XLA on the CPU.

    q: [num_tokens, num_heads, head_dim] float32/bfloat16/float16; query heads h*G..h*G+G-1 share KV
        head h.
    k_pages, v_pages: pages in `layout` (layout.py) in q's dtype, or 16-bit pages under a float32 q,
        already holding this step's new K/V.
    block_tables: int32 [num_seqs, max_blocks_per_seq]
    seq_lens: int32 [num_seqs]; context length including the new tokens, 0 for padding sequences.
    query_start_loc: int32 [num_seqs + 1]; sequence i owns tokens query_start_loc[i]:[i+1].
    max_query_len: static bound on new tokens per sequence; 1 leaves the query-tile path out.
    scale: softmax scale, head_dim**-0.5 by default.
    decode_group: rows with one new token attended together (rows per chunk gather).
    decode_chunk_pages: pages per online-softmax step of those rows.
    prefill_tile: new tokens per query tile of the other rows.
    prefill_chunk_pages: pages per online-softmax step of a query tile.
    layout: of the pages, "token_major" or "head_major" (layout.LAYOUTS).
    sliding_window: a query at position p sees only keys at positions > p - sliding_window; None: all.
    soft_cap: each scaled score s becomes soft_cap * tanh(s / soft_cap) (Gemma 2); None: as it is.
    returns [num_tokens, num_heads, head_dim] in q's dtype; rows of padding tokens are 0.
    """
    _check_inputs(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, max_query_len, layout)
    for name, knob in dict(
        decode_group=decode_group, decode_chunk_pages=decode_chunk_pages, prefill_tile=prefill_tile,
        prefill_chunk_pages=prefill_chunk_pages,
    ).items():
        if knob < 1:
            raise ValueError(f"{name} must be >= 1, got {knob}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    return _paged_attention_xla(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
        tiles=max_query_len > 1, scale=q.shape[2] ** -0.5 if scale is None else scale,
        decode_group=min(decode_group, block_tables.shape[0]), decode_chunk_pages=decode_chunk_pages,
        prefill_tile=min(prefill_tile, q.shape[0]), prefill_chunk_pages=prefill_chunk_pages, layout=layout,
        window=sliding_window, soft_cap=soft_cap,
    )


@functools.partial(
    jax.jit,
    static_argnames=("tiles", "scale", "decode_group", "decode_chunk_pages", "prefill_tile",
                     "prefill_chunk_pages", "layout", "window", "soft_cap"),
)
def _paged_attention_xla(
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *, tiles, scale, decode_group,
    decode_chunk_pages, prefill_tile, prefill_chunk_pages, layout, window, soft_cap,
):
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    out = _decode(
        jnp.zeros(q.shape, q.dtype), q, k_pages, v_pages, block_tables, jnp.where(q_lens == 1, seq_lens, 0),
        query_start_loc, scale=scale, group_rows=decode_group, chunk_pages=decode_chunk_pages, layout=layout,
        window=window, soft_cap=soft_cap,
    )
    if tiles:  # prefill_tile was bounded by num_tokens in paged_attention_xla
        out = _prefill(out, q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
                       jnp.where(q_lens > 1, q_lens, 0), scale=scale, tile=prefill_tile,
                       chunk_pages=prefill_chunk_pages, layout=layout, window=window, soft_cap=soft_cap)
    return out


def _decode(out, q, k_pages, v_pages, block_tables, lengths, query_start_loc, *, scale, group_rows,
            chunk_pages, layout, window, soft_cap):
    """Writes the attention of the rows with one new token into `out`.

    out, q: [num_tokens, num_heads, head_dim]; block_tables: int32 [rows, max_blocks];
    lengths: int32 [rows], the context length of each row with one new token (its last position's
    query attends to all of it, or its last `window`), 0 for the rows left to the tiles;
    query_start_loc: int32 [rows + 1].
    returns out with those rows' tokens set.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = page_dims(k_pages, layout)
    group = num_heads // kv_heads
    chunk = chunk_pages * block_size
    rows = block_tables.shape[0]
    num_groups = cdiv(rows, group_rows)
    padded_rows = num_groups * group_rows
    lengths = jnp.pad(lengths, (0, padded_rows - rows))
    # Longest first, so each group's trip count is set by rows of about its own length.
    order = jnp.argsort(-lengths)
    tables = pad_to(jnp.pad(block_tables, ((0, padded_rows - rows), (0, 0))), chunk_pages)[order]
    tables = tables.reshape(num_groups, group_rows, -1)
    token = jnp.where(lengths > 0, jnp.pad(query_start_loc[:-1], (0, padded_rows - rows)), num_tokens)[order]
    queries = q.at[token].get(mode="fill", fill_value=0).astype(jnp.float32) * scale
    queries = queries.reshape(num_groups, group_rows, kv_heads, group, head_dim)
    lengths = lengths[order].reshape(num_groups, group_rows)

    def attend_group(g, results):
        lens, table, qg = lengths[g], tables[g], queries[g]

        def step(i, carry):
            pages = lax.dynamic_slice_in_dim(table, i * chunk_pages, chunk_pages, axis=1)
            pos = i * chunk + jnp.arange(chunk)
            valid = pos < lens[:, None]  # [rows, chunk]
            if window is not None:
                valid &= pos >= lens[:, None] - window
            k, v = chunk_kv(k_pages, v_pages, pages, valid, i * chunk < lens[0], layout)
            s = capped(jnp.einsum("bhcd,bhgd->bhgc", k, qg), soft_cap)
            return online_softmax_step(carry, s, valid[:, None, None], v, "bhgc,bhcd->bhgd")

        carry = online_softmax_init((group_rows, kv_heads, group), head_dim)
        end = cdiv(lens[0], chunk)
        first = 0
        if window is not None:  # the chunk of the group's earliest visible key; rows of length 0 see none
            earliest = jnp.min(jnp.where(lens > 0, jnp.maximum(lens - window, 0), jnp.iinfo(jnp.int32).max))
            first = jnp.minimum(earliest // chunk, end)
        carry = lax.fori_loop(first, end, step, carry)
        return results.at[g].set(online_softmax_result(carry))

    results = jnp.zeros((num_groups, group_rows, kv_heads, group, head_dim), jnp.float32)
    results = lax.fori_loop(0, num_groups, attend_group, results)
    results = results.reshape(padded_rows, num_heads, head_dim).astype(out.dtype)
    return out.at[token].set(results, mode="drop")


def _prefill(out, q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, q_lens, *, scale, tile,
             chunk_pages, layout, window, soft_cap):
    """Writes the attention of the rows with several new tokens into `out`, a tile of `tile` at a time.

    out, q: [num_tokens, num_heads, head_dim] with num_tokens >= tile; block_tables: int32
    [rows, max_blocks]; seq_lens: int32 [rows]; query_start_loc: int32 [rows + 1];
    q_lens: int32 [rows], each row's new tokens, 0 for the rows left to `_decode`.
    returns out with those rows' tokens set.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = page_dims(k_pages, layout)
    group = num_heads // kv_heads
    chunk = chunk_pages * block_size
    tables = pad_to(block_tables, chunk_pages)
    row_tiles = cdiv(q_lens, tile)
    tiles_end = jnp.cumsum(row_tiles)  # [rows] one past each row's last tile

    def attend_tile(t, out):
        row = jnp.searchsorted(tiles_end, t, side="right")
        q_len, seq_len, first = q_lens[row], seq_lens[row], query_start_loc[row]
        offset = (t - tiles_end[row] + row_tiles[row]) * tile  # the tile's first token among the row's
        # Near the end of the batch the slice is shifted back to stay in bounds (dynamic_slice would
        # clamp it anyway); positions are computed from where it really starts.
        start = jnp.minimum(first + offset, num_tokens - tile)
        rel = start - first + jnp.arange(tile)  # [tile] index among the row's new tokens
        mine = (rel >= offset) & (rel < jnp.minimum(offset + tile, q_len))
        # Row m of the dots is token m // group of the tile: [kv_heads, tile * group, head_dim].
        q_pos = jnp.repeat(seq_len - q_len + rel, group)  # < seq_len for the tile's own tokens
        qt = lax.dynamic_slice_in_dim(q, start, tile).astype(jnp.float32) * scale
        qt = qt.reshape(tile, kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)
        table = tables[row]
        kv_end = jnp.minimum(seq_len - q_len + offset + tile, seq_len)  # causal bound of the tile's last query
        # The first key the tile's first token sees (the tokens before it, in a tile shifted back, are not its own).
        kv_start = 0 if window is None else jnp.maximum(seq_len - q_len + offset - window + 1, 0)

        def step(i, carry):
            pages = lax.dynamic_slice_in_dim(table, i * chunk_pages, chunk_pages)
            kv_pos = i * chunk + jnp.arange(chunk)
            k, v = chunk_kv(k_pages, v_pages, pages, (kv_pos < seq_len) & (kv_pos >= kv_start), i * chunk < kv_end,
                            layout)
            s = capped(jnp.einsum("hmd,hkd->hmk", qt, k), soft_cap)
            seen = kv_pos <= q_pos[:, None]
            if window is not None:
                seen &= kv_pos > q_pos[:, None] - window
            return online_softmax_step(carry, s, seen, v, "hmk,hkd->hmd")

        carry = online_softmax_init((kv_heads, tile * group), head_dim)
        carry = lax.fori_loop(kv_start // chunk, cdiv(kv_end, chunk), step, carry)
        result = online_softmax_result(carry).reshape(kv_heads, tile, group, head_dim)
        result = result.transpose(1, 0, 2, 3).reshape(tile, num_heads, head_dim).astype(out.dtype)
        old = lax.dynamic_slice_in_dim(out, start, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None, None], result, old), start, 0)

    return lax.fori_loop(0, tiles_end[-1], attend_tile, out)


def _check_inputs(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, max_query_len, layout):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must both be {layout} pages, 4-d and of one shape, got {k_pages.shape}"
            f" and {v_pages.shape}"
        )
    _, _, kv_heads, head_dim = page_dims(k_pages, layout)
    if head_dim != q.shape[2] or q.shape[1] % kv_heads:
        raise ValueError(
            f"q's heads {q.shape[1]} must be a multiple of the pages' {kv_heads} and head_dim"
            f" {q.shape[2]} equal theirs {head_dim}"
        )
    if v_pages.dtype != k_pages.dtype or q.dtype not in (k_pages.dtype, jnp.float32):
        raise ValueError(
            f"k_pages and v_pages must share a dtype, and q have it or be float32, got {q.dtype}, {k_pages.dtype}, "
            f"{v_pages.dtype}"
        )
    num_seqs = block_tables.shape[0]
    if block_tables.ndim != 2 or seq_lens.shape != (num_seqs,) or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            "expected block_tables [num_seqs, max_blocks], seq_lens [num_seqs], query_start_loc"
            f" [num_seqs + 1], got {block_tables.shape}, {seq_lens.shape}, {query_start_loc.shape}"
        )
    for name, a in dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc).items():
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
