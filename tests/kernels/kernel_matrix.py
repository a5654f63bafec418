"""The Pallas kernel's test matrix, random paged batches and a float64 oracle: shared by
tests/test_paged_attention.py (interpret mode on the CPU) and scripts/gpu_check.py (compiled on a GPU).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import layout
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.reference import paged_attention_reference

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
TRAILING_PAD_TOKENS = 3  # flat-batch tokens past the last sequence, as a bucketed step has


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]  # new tokens per sequence; 0 with seq_len 0 = padding sequence
    seq_lens: tuple[int, ...]  # context incl. new tokens
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: type = jnp.float32
    knobs: tuple[tuple[str, int], ...] = ()  # kernel tuning keywords
    layout: str = layout.TOKEN_MAJOR  # of the pages (layout.LAYOUTS)
    sliding_window: int | None = None  # a query at position p sees keys at positions > p - sliding_window
    soft_cap: float | None = None  # scores s become soft_cap * tanh(s / soft_cap) (Gemma 2)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)


def behind_window(case, i: int) -> int:
    """Blocks of sequence i that lie wholly before the window of its first new token: the engine may
    have freed them, so they are poisoned too. (Any case with q_lens, seq_lens, block_size and
    sliding_window: the kernel tests' and the CPU tests' both.)"""
    if case.sliding_window is None or case.q_lens[i] == 0:
        return 0
    return max(0, case.seq_lens[i] - case.q_lens[i] - case.sliding_window + 1) // case.block_size


@dataclasses.dataclass(frozen=True)
class Batch:
    """A step's inputs, plus the contiguous per-sequence K/V they were written from."""

    q: jax.Array  # [num_tokens, num_heads, head_dim]
    k_pages: jax.Array  # pages in the case's layout; NaN in every unwritten slot
    v_pages: jax.Array
    block_tables: jax.Array  # int32 [num_seqs, max_blocks]
    seq_lens: jax.Array  # int32 [num_seqs]
    query_start_loc: jax.Array  # int32 [num_seqs + 1]
    k_dense: list[np.ndarray]  # per sequence [seq_len, num_kv_heads, head_dim], as stored (rounded)
    v_dense: list[np.ndarray]

    @property
    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.block_tables, self.seq_lens, self.query_start_loc)


def make_batch(case: Case, seed: int = 0, poison=np.nan) -> Batch:
    """Random K/V written through randomly permuted block tables into pages in the case's layout;
    `poison` fills all other slots, and the blocks behind each sequence's window."""
    rng = np.random.default_rng(seed)
    bs, kvh, dim = case.block_size, case.num_kv_heads, case.head_dim
    blocks_needed = [-(-n // bs) for n in case.seq_lens]
    max_blocks = max(blocks_needed) + 1  # a spare column: entries past a sequence's blocks must not be read
    num_blocks = sum(blocks_needed) + 3
    pages = rng.permutation(num_blocks)
    block_tables = rng.integers(0, num_blocks, (len(case.seq_lens), max_blocks))
    k_pages = np.full((num_blocks, bs, kvh, dim), poison, np.float32)
    v_pages = np.full_like(k_pages, poison)
    k_dense, v_dense = [], []
    for i, n in enumerate(case.seq_lens):
        block_tables[i, : blocks_needed[i]], pages = pages[: blocks_needed[i]], pages[blocks_needed[i] :]
        k = np.asarray(jnp.asarray(rng.standard_normal((n, kvh, dim)), case.dtype).astype(jnp.float32))
        v = np.asarray(jnp.asarray(rng.standard_normal((n, kvh, dim)), case.dtype).astype(jnp.float32))
        pos = np.arange(n)
        k_pages[block_tables[i, pos // bs], pos % bs] = k
        v_pages[block_tables[i, pos // bs], pos % bs] = v
        k_dense.append(k)
        v_dense.append(v)
        k_pages[block_tables[i, : behind_window(case, i)]] = poison
        v_pages[block_tables[i, : behind_window(case, i)]] = poison
    query_start_loc = np.concatenate([[0], np.cumsum(case.q_lens)])
    num_tokens = int(query_start_loc[-1]) + TRAILING_PAD_TOKENS
    return Batch(
        q=jnp.asarray(rng.standard_normal((num_tokens, case.num_heads, dim)), case.dtype),
        k_pages=layout.convert(jnp.asarray(k_pages, case.dtype), layout.TOKEN_MAJOR, case.layout),
        v_pages=layout.convert(jnp.asarray(v_pages, case.dtype), layout.TOKEN_MAJOR, case.layout),
        block_tables=jnp.asarray(block_tables, jnp.int32),
        seq_lens=jnp.asarray(case.seq_lens, jnp.int32),
        query_start_loc=jnp.asarray(query_start_loc, jnp.int32),
        k_dense=k_dense,
        v_dense=v_dense,
    )


def dense_attention(case: Case, batch: Batch) -> np.ndarray:
    """float64 causal attention (within the case's window) per sequence over its contiguous K/V:
    [num_tokens, num_heads, head_dim]."""
    q = np.asarray(batch.q.astype(jnp.float32), np.float64)
    group = case.num_heads // case.num_kv_heads
    out = np.zeros_like(q)
    start = 0
    for q_len, n, k, v in zip(case.q_lens, case.seq_lens, batch.k_dense, batch.v_dense):
        if q_len == 0:
            continue
        k = np.repeat(k.astype(np.float64), group, axis=1)  # [n, heads, dim]
        v = np.repeat(v.astype(np.float64), group, axis=1)
        qs = q[start : start + q_len]  # [q_len, heads, dim]
        scores = np.einsum("qhd,khd->hqk", qs, k) / np.sqrt(case.head_dim)
        if case.soft_cap is not None:
            scores = case.soft_cap * np.tanh(scores / case.soft_cap)
        q_pos = (n - q_len + np.arange(q_len))[:, None]
        causal = np.arange(n)[None, :] <= q_pos  # [q_len, n]
        if case.sliding_window is not None:
            causal &= np.arange(n)[None, :] > q_pos - case.sliding_window
        scores = np.where(causal, scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[start : start + q_len] = np.einsum("hqk,khd->qhd", p / p.sum(axis=-1, keepdims=True), v)
        start += q_len
    return out


def rel_err(x, expected) -> float:
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(x - expected) / np.linalg.norm(expected))


def case_id(case: Case) -> str:
    kind = "decode" if case.max_query_len == 1 else "prefill"
    knobs = "".join(f"-{k}{v}" for k, v in case.knobs)
    window = "" if case.sliding_window is None else f"-window{case.sliding_window}"
    cap = "" if case.soft_cap is None else f"-cap{case.soft_cap:g}"
    return (
        f"{kind}-h{case.num_heads}kv{case.num_kv_heads}-d{case.head_dim}-bs{case.block_size}"
        f"-{jnp.dtype(case.dtype).name}{knobs}-{case.layout}{window}{cap}"
    )


DECODE = dict(q_lens=(1, 1, 0, 1, 1), seq_lens=(37, 1, 0, 100, 16))
# A whole prompt, a later chunk of a longer one (cached prefix), a padding row, a decode row, a
# prompt of exactly one block, one spanning three query blocks.
PREFILL = dict(q_lens=(5, 13, 0, 1, 8, 40), seq_lens=(5, 30, 0, 9, 8, 45))

CASES = [
    # Group sizes 3 (SmolLM2: 9 heads over 3), 4, 1 and 8; every head_dim, block size and dtype.
    Case(**DECODE, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16),
    Case(**DECODE, num_heads=8, num_kv_heads=2, head_dim=128, block_size=8, dtype=jnp.bfloat16),
    Case(**DECODE, num_heads=4, num_kv_heads=4, head_dim=64, block_size=32),
    Case(**DECODE, num_heads=16, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.bfloat16),
    Case(**PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8),
    Case(**PREFILL, num_heads=9, num_kv_heads=3, head_dim=128, block_size=32, dtype=jnp.bfloat16),
    Case(**PREFILL, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16),
    Case(**PREFILL, num_heads=8, num_kv_heads=8, head_dim=64, block_size=32, dtype=jnp.bfloat16),
    Case(**PREFILL, num_heads=16, num_kv_heads=2, head_dim=64, block_size=8),
    Case(**PREFILL, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float16),
    # Knobs: K/V tiles smaller than a page; many query blocks of two tokens and K/V tiles of 16 pages.
    Case(**PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=32, knobs=(("block_k", 16),)),
    Case(
        **PREFILL, num_heads=8, num_kv_heads=1, head_dim=64, block_size=8,
        knobs=(("block_q", 2), ("block_k", 128)),
    ),
]
# Head-major pages on a subset, chosen to vary what the layout touches: the page and slot of each K/V
# row (decode over pages of 8; tiles of 16 inside pages of 32; tiles of 128 across 16 pages of 8).
CASES += [dataclasses.replace(CASES[i], layout=layout.HEAD_MAJOR) for i in (1, 10, 11)]
# Gemma 3's shapes: head_dim 256, sliding windows (shorter than a page, and across several), over decode
# rows, whole prompts, a chunk after a cached prefix, query blocks whose rows start their windows in
# different K/V tiles; blocks wholly behind a window are poisoned.
CASES += [
    Case(**DECODE, num_heads=8, num_kv_heads=4, head_dim=256, block_size=16),
    Case(**DECODE, num_heads=8, num_kv_heads=4, head_dim=256, block_size=16, sliding_window=20),
    Case(**DECODE, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8, sliding_window=5, dtype=jnp.bfloat16),
    Case(**PREFILL, num_heads=4, num_kv_heads=1, head_dim=256, block_size=16, sliding_window=7),
    Case(**PREFILL, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8, sliding_window=16,
         knobs=(("block_q", 8), ("block_k", 16))),
    Case(**PREFILL, num_heads=8, num_kv_heads=2, head_dim=128, block_size=32, sliding_window=12,
         dtype=jnp.bfloat16, layout=layout.HEAD_MAJOR),
]
# Gemma 2's scores soft-capped (a cap of 2 bends most of them), with and without a window.
CASES += [
    Case(**DECODE, num_heads=8, num_kv_heads=4, head_dim=256, block_size=16, soft_cap=2.0),
    Case(**PREFILL, num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, sliding_window=9, soft_cap=2.0),
]


def check_kernel(case: Case, *, interpret: bool, seed: int = 0) -> tuple[float, list[str]]:
    """Run the kernel on a random batch of `case` (unwritten slots NaN) against the dense float64
    oracle and the jnp reference: (its relative error against the oracle, problems found; none when
    the case passes)."""
    batch = make_batch(case, seed)
    dense = dense_attention(case, batch)
    out = paged_attention(*batch.args, max_query_len=case.max_query_len, interpret=interpret, layout=case.layout,
                          sliding_window=case.sliding_window, soft_cap=case.soft_cap, **dict(case.knobs))
    ref = paged_attention_reference(*batch.args, max_query_len=case.max_query_len, layout=case.layout,
                                    sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    tol = TOLERANCE[case.dtype]
    err = rel_err(out, dense)
    checks = {
        "shape and dtype of q": out.shape == batch.q.shape and out.dtype == batch.q.dtype,
        "no NaN from an unwritten page slot": not jnp.isnan(out).any(),
        f"error against float64 below {tol}": err < tol,
        f"reference against float64 below {tol}": rel_err(ref, dense) < tol,
        f"error against the reference below {tol}": rel_err(out, np.asarray(ref.astype(jnp.float32), np.float64)) < tol,
        "tokens of no sequence are 0": not np.asarray(out[-TRAILING_PAD_TOKENS:]).any(),
    }
    return err, [name for name, ok in checks.items() if not ok]
