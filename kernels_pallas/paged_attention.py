"""Paged attention for CUDA GPUs: a Pallas kernel over paged K/V, decode and ragged prefill.

Computes exactly what `reference.paged_attention_reference` computes (same signature, same masking
conventions; see metadata.py): each sequence's new tokens attend causally over its cached prefix plus
themselves, reading K/V page by page through the block table, with a flash-attention online softmax,
so gathered K/V is never materialised.

Backend: Pallas' Triton lowering, chosen because it runs on Ampere and Hopper alike (Mosaic GPU targets
Hopper first) and because it lowers on a CPU-only machine, so the CUDA lowering is checked in CI here.
Mosaic GPU is where JAX is going; the Triton-specific parts are the masked `plgpu.load`/`plgpu.store`
in the kernel body and `plgpu.CompilerParams` in `_pallas_call`. A Mosaic GPU kernel would replace
those two layers and keep `paged_attention`'s signature, which is the seam the model calls through.

Grid: (sequence, kv head, query block). One program owns `block_q` consecutive new tokens of one
sequence times the query heads of one KV head, padded to a power of two `group_pad` (9 heads over 3 KV
heads: group 3 padded to 4, the padding heads masked). Its rows, M = block_q * group_pad, form one tile
so that the whole group shares each K/V tile it reads (GQA costs no extra K/V traffic). It walks the
sequence's K/V in tiles of `block_k` tokens, stopping at its last query's causal bound. Every tile,
query or K/V, is read with a gather index (token -> page through the block table, slot in page, kv
head, dim), so block_size need not divide block_k or be a power of two, and no reshape is needed.
`layout.index` orders that index for the pages' layout, so one kernel body serves both layouts: a
token-major tile is block_size rows of head_dim at a stride of num_kv_heads * head_dim, a head-major
tile is block_size * head_dim contiguous values (as JAX's own kernel reads its pages).

Sliding window (a query at position p sees keys at positions > p - window): a program starts its walk
at the tile of its first row's first visible key, loads nothing before that key, and masks each row's
own bound. The window is static: one program per window.

NaN-safety: K/V slots past seq_len are loaded masked, as 0, and masked scores are replaced (never
multiplied) by a mask value; padded query rows and heads are never stored, and tokens of no sequence
keep the zeros the output starts with.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.layout import TOKEN_MAJOR, index, page_dims

# Finite rather than -inf so a row with no valid key in the current tile keeps its running max finite,
# and exp(m_prev - m_new) never sees inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Triton's tl.dot needs every matrix dimension to be at least 16.
MIN_DOT_DIM = 16


def paged_attention_kernel(
    # inputs (whole arrays in GPU memory; programs index into them)
    q_ref,  # [num_tokens, num_heads, head_dim]
    k_pages_ref,  # pages in `layout` (layout.py)
    v_pages_ref,  # pages in `layout`
    block_tables_ref,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ref,  # int32 [num_seqs]
    query_start_loc_ref,  # int32 [num_seqs + 1]
    o_zeros_ref,  # [num_tokens, num_heads, head_dim], aliased to o_ref
    # outputs
    o_ref,  # [num_tokens, num_heads, head_dim]; rows of other programs must be left untouched
    *,
    scale: float,
    group: int,
    group_pad: int,
    block_q: int,
    block_k: int,
    layout: str,
    window: int | None,
    soft_cap: float | None,
):
    del o_zeros_ref  # only there to give o_ref its zeros
    seq, kv_head, q_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_tokens, num_heads, head_dim = q_ref.shape
    block_size = page_dims(k_pages_ref, layout)[1]
    max_blocks = block_tables_ref.shape[1]
    rows = block_q * group_pad

    q_start = query_start_loc_ref[seq]
    q_len = query_start_loc_ref[seq + 1] - q_start
    seq_len = seq_lens_ref[seq]

    # Row r of the tile is new token q_block * block_q + r // group_pad, query head r % group_pad of
    # this KV head's group.
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    qi = q_block * block_q + r // group_pad  # [rows, 1] index among the sequence's new tokens
    head = kv_head * group + r % group_pad  # [rows, 1]
    row_valid = (qi < q_len) & (r % group_pad < group)  # [rows, 1]
    q_pos = seq_len - q_len + qi  # [rows, 1] position of the row's token in its context
    # Invalid rows point one past the end: masked on the GPU, clamped (load) or dropped (store) in
    # interpret mode, so they can never alias a row another lane writes.
    token = jnp.where(row_valid, q_start + qi, num_tokens)  # [rows, 1]
    dim = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)  # [1, head_dim]

    q = plgpu.load(q_ref.at[token, head, dim], mask=row_valid, other=0)  # [rows, head_dim]
    # f32 inputs get IEEE f32 products (Triton would otherwise use TF32) to match the reference.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT

    # Keys past the last valid query's position are causally masked for the whole tile: skip them.
    last_q = jnp.minimum((q_block + 1) * block_q, q_len)
    kv_end = jnp.where(q_block * block_q < q_len, seq_len - q_len + last_q, 0)
    # Keys before the first row's window are masked for the whole tile: never loaded.
    kv_start = 0 if window is None else jnp.maximum(seq_len - q_len + q_block * block_q - window + 1, 0)
    col = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # [block_k, 1]

    def body(i, carry):
        acc, m_prev, l_prev = carry  # [rows, head_dim], [rows, 1], [rows, 1] (f32)
        kv_pos = i * block_k + col  # [block_k, 1]
        kv_valid = (kv_pos < seq_len) & (kv_pos >= kv_start)
        # Table entries past the sequence's last block may hold anything: clamp the table read, and
        # the masked loads below never dereference the pages of invalid positions.
        page = block_tables_ref[seq, jnp.minimum(kv_pos // block_size, max_blocks - 1)]  # [block_k, 1]
        slot = kv_pos % block_size
        # Slots past seq_len may hold anything, NaN included: they are never read, and read as 0.
        at = index(layout, page, slot, kv_head, dim)
        k = plgpu.load(k_pages_ref.at[at], mask=kv_valid, other=0)  # [block_k, D]
        v = plgpu.load(v_pages_ref.at[at], mask=kv_valid, other=0)  # [block_k, D]

        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [rows, block_k]
        mask = kv_valid.T & (kv_pos.T <= q_pos)  # [rows, block_k]
        if window is not None:
            mask &= kv_pos.T > q_pos - window
        s = s * scale
        if soft_cap is not None:  # Gemma 2's cap on the scores
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, MASK_VALUE)

        # Every valid row sees key 0 in the first tile, so from then on m is a real score and
        # exp(MASK_VALUE - m) is exactly 0: masked keys get no weight without a second select.
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)  # [rows, block_k]
        if window is not None:
            # A row whose window starts after the first tile's keys has no real score there (m stays
            # MASK_VALUE, and its masked keys would weigh exp(0) = 1 until its first real score
            # rescales them away): zero them outright.
            p = jnp.where(mask, p, 0.0)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32,
        )  # [rows, head_dim]
        return alpha * acc + pv, m_new, l_new

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
    )
    acc, _, l = lax.fori_loop(kv_start // block_k, pl.cdiv(kv_end, block_k), body, init)
    # l >= 1 on valid rows; the others (l may be 0) are not stored.
    plgpu.store(o_ref.at[token, head, dim], (acc / l).astype(o_ref.dtype), mask=row_valid)


def _pallas_call(
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, *,
    max_query_len, scale, block_q, block_k, num_warps, num_stages, interpret, layout, sliding_window, soft_cap,
):
    num_heads = q.shape[1]
    num_kv_heads = page_dims(k_pages, layout)[2]
    group = num_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    kernel = functools.partial(
        paged_attention_kernel, scale=scale, group=group, group_pad=group_pad, block_q=block_q,
        block_k=block_k, layout=layout, window=sliding_window, soft_cap=soft_cap,
    )
    # No BlockSpecs: tiles are ragged (a sequence's tokens start anywhere) and paged, so the kernel
    # computes its own indices into whole arrays. The output starts as zeros (aliased in, so it is
    # written in place) because tokens past the last sequence belong to no program.
    return pl.pallas_call(
        kernel,
        grid=(block_tables.shape[0], num_kv_heads, pl.cdiv(max_query_len, block_q)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_{layout}_{block_q=}_{block_k=}_{group_pad=}_window={sliding_window or 0}",
    )(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, jnp.zeros_like(q))


def default_block_q(max_query_len: int, group: int) -> int:
    """Query tokens per program: enough for a 16-row dot, at most about 64 rows, never past the bucket."""
    group_pad = pl.next_power_of_2(group)
    fill_dot = max(1, MIN_DOT_DIM // group_pad)
    return max(fill_dot, min(pl.next_power_of_2(max_query_len), max(1, 64 // group_pad)))


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_inputs(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, max_query_len, layout):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must both be {layout} pages, 4-d and of one shape, got {k_pages.shape}"
            f" and {v_pages.shape}"
        )
    num_heads, head_dim = q.shape[1:]
    _, _, num_kv_heads, pages_head_dim = page_dims(k_pages, layout)
    if pages_head_dim != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but the pages have {pages_head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not _is_power_of_2(head_dim) or head_dim < MIN_DOT_DIM:
        raise ValueError(f"head_dim must be a power of two >= {MIN_DOT_DIM} (Triton tiles), got {head_dim}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(
            f"q, k_pages and v_pages must share a dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks_per_seq], got {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must have shape ({num_seqs},), got {seq_lens.shape}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must have shape ({num_seqs + 1},), got {query_start_loc.shape}")
    for name, a in dict(block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc).items():
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")


def _check_blocks(block_q, block_k, group):
    group_pad = pl.next_power_of_2(group)
    if not _is_power_of_2(block_q) or block_q * group_pad < MIN_DOT_DIM:
        raise ValueError(
            f"block_q must be a power of two with block_q * {group_pad} (padded group) >= {MIN_DOT_DIM},"
            f" got {block_q}"
        )
    if not _is_power_of_2(block_k) or block_k < MIN_DOT_DIM:
        raise ValueError(f"block_k must be a power of two >= {MIN_DOT_DIM}, got {block_k}")


@functools.partial(
    jax.jit,
    static_argnames=("max_query_len", "scale", "block_q", "block_k", "num_warps", "num_stages", "interpret",
                     "layout", "sliding_window", "soft_cap"),
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    *,
    max_query_len: int,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    layout: str = TOKEN_MAJOR,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of ragged new tokens over their sequences' paged K/V (Pallas, Triton backend).

    q: [num_tokens, num_heads, head_dim] float32/bfloat16/float16; query heads h*G..h*G+G-1 share KV
        head h. head_dim must be a power of two >= 16.
    k_pages, v_pages: pages in `layout` in q's dtype, already holding this step's new K/V; any
        block_size. Token-major [num_blocks, block_size, num_kv_heads, head_dim] or head-major
        [num_blocks, num_kv_heads, block_size, head_dim] (layout.py).
    block_tables: int32 [num_seqs, max_blocks_per_seq]
    seq_lens: int32 [num_seqs]; context length including the new tokens, 0 for padding sequences.
    query_start_loc: int32 [num_seqs + 1]; sequence i owns tokens query_start_loc[i]:[i+1].
    max_query_len: static bound on new tokens per sequence (1 for pure decode).
    scale: softmax scale, head_dim**-0.5 by default.
    block_q: new tokens per program (power of two, block_q * padded group >= 16); by default
        `default_block_q(max_query_len, group)`.
    block_k: K/V tokens per inner step (power of two >= 16).
    num_warps, num_stages: Triton launch parameters.
    interpret: run the kernel body with the Pallas interpreter (any platform, slow).
    layout: of the pages, "token_major" or "head_major" (layout.LAYOUTS).
    sliding_window: a query at position p sees only keys at positions > p - sliding_window; None: all.
    soft_cap: each scaled score s becomes soft_cap * tanh(s / soft_cap) (Gemma 2); None: as it is.
    returns [num_tokens, num_heads, head_dim] in q's dtype; rows of padding tokens are 0.
    """
    _check_inputs(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, max_query_len, layout)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
    group = q.shape[1] // page_dims(k_pages, layout)[2]
    block_q = default_block_q(max_query_len, group) if block_q is None else block_q
    _check_blocks(block_q, block_k, group)
    return _pallas_call(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc,
        max_query_len=max_query_len, scale=q.shape[2] ** -0.5 if scale is None else scale,
        block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
        layout=layout, sliding_window=sliding_window, soft_cap=soft_cap,
    )
