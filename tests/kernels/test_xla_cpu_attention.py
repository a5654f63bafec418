"""The XLA CPU paged attention (kernels_pallas/cpu/xla.py) against the jnp reference: decode rows,
query tiles and mixes of both, with NaN in every unwritten slot and permuted, over-wide block tables."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from kernels_pallas import layout
from kernels_pallas.metadata import AttentionMetadata
from kernels_pallas.reference import paged_attention_reference
from kernels_pallas.cpu.xla import paged_attention_xla
from kernel_matrix import behind_window

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
TRAILING_PAD_TOKENS = 3  # flat-batch tokens of no sequence, as a bucketed step has


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]  # new tokens per sequence; 0 with seq_len 0 = padding sequence
    seq_lens: tuple[int, ...]  # context incl. new tokens
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: type = jnp.float32
    knobs: tuple[tuple[str, int], ...] = ()  # tuning keywords of paged_attention_xla
    layout: str = layout.TOKEN_MAJOR  # of the pages (layout.LAYOUTS)
    sliding_window: int | None = None  # a query at position p sees keys at positions > p - sliding_window
    soft_cap: float | None = None  # scores s become soft_cap * tanh(s / soft_cap) (Gemma 2)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)


def make_inputs(case: Case, seed: int = 0):
    """(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc) with NaN in every unwritten slot
    and in every block wholly behind a sequence's window (kernel_matrix.behind_window), pages in the
    case's layout.

    The block tables are twice as wide as a power-of-two bucket of the longest sequence; entries past
    a sequence's blocks point at random pages (other sequences' or all-NaN ones).
    """
    rng = np.random.default_rng(seed)
    bs, kvh, dim = case.block_size, case.num_kv_heads, case.head_dim
    blocks_needed = [-(-n // bs) for n in case.seq_lens]
    width = 2 * (1 << (max(blocks_needed) - 1).bit_length())
    num_blocks = sum(blocks_needed) + 4
    k_pages = np.full((num_blocks, bs, kvh, dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    block_tables = rng.integers(0, num_blocks, (len(case.seq_lens), width))
    pages = rng.permutation(num_blocks)
    for i, n in enumerate(case.seq_lens):
        block_tables[i, : blocks_needed[i]], pages = pages[: blocks_needed[i]], pages[blocks_needed[i] :]
        pos = np.arange(n)
        k_pages[block_tables[i, pos // bs], pos % bs] = rng.standard_normal((n, kvh, dim))
        v_pages[block_tables[i, pos // bs], pos % bs] = rng.standard_normal((n, kvh, dim))
        k_pages[block_tables[i, : behind_window(case, i)]] = np.nan
        v_pages[block_tables[i, : behind_window(case, i)]] = np.nan
    query_start_loc = np.concatenate([[0], np.cumsum(case.q_lens)])
    num_tokens = int(query_start_loc[-1]) + TRAILING_PAD_TOKENS
    return (
        jnp.asarray(rng.standard_normal((num_tokens, case.num_heads, dim)), case.dtype),
        layout.convert(jnp.asarray(k_pages, case.dtype), layout.TOKEN_MAJOR, case.layout),
        layout.convert(jnp.asarray(v_pages, case.dtype), layout.TOKEN_MAJOR, case.layout),
        jnp.asarray(block_tables, jnp.int32),
        jnp.asarray(case.seq_lens, jnp.int32),
        jnp.asarray(query_start_loc, jnp.int32),
    )


def rel_err(x, expected) -> float:
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    return float(np.linalg.norm(x - expected) / np.linalg.norm(expected))


def case_id(case: Case) -> str:
    knobs = "".join(f"-{k}{v}" for k, v in case.knobs)
    window = "" if case.sliding_window is None else f"-window{case.sliding_window}"
    cap = "" if case.soft_cap is None else f"-cap{case.soft_cap:g}"
    return (
        f"q{max(case.q_lens)}-h{case.num_heads}kv{case.num_kv_heads}-d{case.head_dim}"
        f"-bs{case.block_size}-{jnp.dtype(case.dtype).name}{knobs}-{case.layout}{window}{cap}"
    )


# One token per row; a padding row in the middle shifts the later rows' tokens off their row index.
DECODE = dict(q_lens=(1, 1, 0, 1, 1, 1), seq_lens=(37, 1, 0, 100, 16, 64))
# Decode rows first as the engine lays them out, their block padded by a one-token row of length 0
# (paged_jax/core/batch.py), then a padding row (so the prompts' tokens start at the flat index of a row of
# no token), a fresh prompt, a chunk after a cached prefix of 70 tokens, a padding row, a short prompt.
MIXED = dict(q_lens=(1, 1, 1, 1, 0, 37, 60, 0, 5), seq_lens=(50, 17, 33, 0, 0, 37, 130, 0, 5))
# Any order: a prompt, a chunk after a prefix, padding, a decode row, a one-block prompt, a decode row
# and a prompt spanning several tiles.
RAGGED = dict(q_lens=(5, 13, 0, 1, 8, 1, 40), seq_lens=(5, 30, 0, 9, 8, 70, 45))

CASES = [
    # Group sizes 3 (SmolLM2), 4 and 1; head_dim 64 and 128; block sizes 8, 16 and 32; both dtypes.
    Case(**DECODE),
    Case(**DECODE, num_heads=8, num_kv_heads=2, head_dim=128, block_size=8, dtype=jnp.bfloat16),
    Case(**DECODE, num_heads=4, num_kv_heads=4, block_size=32),
    # Groups of 1 and of 4 rows (the last one short), chunks of one and of three pages.
    Case(**DECODE, knobs=(("decode_group", 1), ("decode_chunk_pages", 1))),
    Case(**DECODE, block_size=8, knobs=(("decode_group", 4), ("decode_chunk_pages", 3))),
    Case(**MIXED),
    Case(**MIXED, num_heads=8, num_kv_heads=2, head_dim=128, block_size=32, dtype=jnp.bfloat16),
    Case(**MIXED, num_heads=4, num_kv_heads=4, block_size=8),
    # Tiles of 8 and 16 tokens straddle sequence boundaries (and the last one is shifted back to stay
    # inside the batch); K/V chunks of one and three pages, smaller than the tile or not dividing it.
    Case(**MIXED, knobs=(("prefill_tile", 8), ("prefill_chunk_pages", 1))),
    Case(**MIXED, block_size=8, knobs=(("prefill_tile", 16), ("prefill_chunk_pages", 3), ("decode_group", 2))),
    Case(**RAGGED),
    Case(**RAGGED, num_heads=8, num_kv_heads=2, head_dim=128, block_size=8, dtype=jnp.bfloat16),
    Case(**RAGGED, block_size=32, knobs=(("prefill_tile", 16), ("prefill_chunk_pages", 1))),
    # A full tile whose last query is the first slot of a K/V chunk (prefix 17 + 32 tokens = 3 * 16 + 1).
    Case(q_lens=(17, 40), seq_lens=(17, 57), knobs=(("prefill_tile", 32), ("prefill_chunk_pages", 1))),
]
# Head-major pages on a subset: decode chunks of three pages of 8, a bfloat16 mix of decode rows and
# tiles, tiles of 16 over chunks of three pages (test_cpu/kernel.py runs the float32 ones too).
CASES += [dataclasses.replace(CASES[i], layout=layout.HEAD_MAJOR) for i in (4, 6, 9)]
# Sliding windows (Mistral's, Gemma's sliding layers): of one key, inside a page, across chunks and tiles;
# decode groups whose rows start their windows in different chunks; head_dim 256 (Gemma 3).
CASES += [
    Case(**DECODE, sliding_window=20, knobs=(("decode_group", 4), ("decode_chunk_pages", 1))),
    Case(**DECODE, num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=1),
    Case(**MIXED, sliding_window=16),
    Case(**MIXED, block_size=8, sliding_window=9, knobs=(("prefill_tile", 16), ("prefill_chunk_pages", 1))),
    Case(**RAGGED, num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=7),
    Case(**RAGGED, num_heads=8, num_kv_heads=2, head_dim=256, block_size=8, dtype=jnp.bfloat16, sliding_window=12,
         layout=layout.HEAD_MAJOR),
    Case(q_lens=(1, 1, 64, 1), seq_lens=(300, 5, 200, 129), head_dim=256, block_size=32, sliding_window=100),
    # Gemma 2's soft-capped scores (a cap of 2 bends most of them), alone and with a window.
    Case(**MIXED, soft_cap=2.0),
    Case(**RAGGED, num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=7, soft_cap=2.0),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(case):
    inputs = make_inputs(case)
    assert jnp.isnan(inputs[1]).any() and jnp.isnan(inputs[2]).any(), "unwritten slots must be poisoned"
    out = paged_attention_xla(*inputs, max_query_len=case.max_query_len, layout=case.layout,
                              sliding_window=case.sliding_window, soft_cap=case.soft_cap, **dict(case.knobs))
    ref = paged_attention_reference(*inputs, max_query_len=case.max_query_len, layout=case.layout,
                                    sliding_window=case.sliding_window, soft_cap=case.soft_cap)

    assert out.shape == inputs[0].shape and out.dtype == inputs[0].dtype
    assert not jnp.isnan(out).any(), "a NaN from an unwritten page slot reached the output"
    assert rel_err(out, ref) < TOLERANCE[case.dtype]
    assert not np.asarray(out[-TRAILING_PAD_TOKENS:], np.float32).any(), "tokens of no sequence must be 0"
    empty = np.asarray(inputs[5][:-1])[(np.diff(inputs[5]) == 1) & (np.asarray(inputs[4]) == 0)]
    assert not np.asarray(out[empty], np.float32).any(), "the token of a row of length 0 must be 0"


def test_long_contexts_take_many_chunks_and_tiles():
    """Several decode groups of different lengths, and prompts of several tiles and K/V chunks each."""
    rng = np.random.default_rng(4)
    decodes = tuple(int(n) for n in rng.integers(1, 300, 21))
    case = Case(
        q_lens=(1,) * 21 + (70, 130, 3), seq_lens=decodes + (70, 250, 203), block_size=8,
        knobs=(("decode_group", 8), ("decode_chunk_pages", 4), ("prefill_tile", 32), ("prefill_chunk_pages", 4)),
    )
    inputs = make_inputs(case, seed=4)
    out = paged_attention_xla(*inputs, max_query_len=case.max_query_len, **dict(case.knobs))
    ref = paged_attention_reference(*inputs, max_query_len=case.max_query_len)
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_work_does_not_grow_with_the_page_pool(dtype):
    """XLA once converted a bfloat16 pool to float32 whole, at every call: temp memory twice the pool."""
    case = Case(**MIXED, dtype=dtype)
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc = make_inputs(case)
    spare = jnp.zeros((4096, *k_pages.shape[1:]), dtype)  # free pages of a large cache
    k_pages, v_pages = jnp.concatenate([k_pages, spare]), jnp.concatenate([v_pages, spare])
    f = jax.jit(lambda *a: paged_attention_xla(*a, max_query_len=64))
    compiled = f.lower(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < k_pages.nbytes / 4


@pytest.mark.parametrize("batch", [MIXED, DECODE], ids=["mixed", "decode"])
def test_scale_and_bucketed_max_query_len(batch):
    """A bucket past every row's new tokens; with one token per row, the tile path runs no tile."""
    inputs = make_inputs(Case(**batch), seed=1)
    out = paged_attention_xla(*inputs, max_query_len=128, scale=0.3)
    ref = paged_attention_reference(*inputs, max_query_len=128, scale=0.3)
    assert rel_err(out, ref) < TOLERANCE[jnp.float32]
    assert rel_err(paged_attention_reference(*inputs, max_query_len=128), ref) > 0.01, "scale must matter"


def test_seam_under_jit():
    """The model calls the seam inside its jitted step."""
    case = Case(**MIXED)
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc = make_inputs(case, seed=2)

    @jax.jit
    def step(q, k_pages, v_pages, metadata):
        return kernels_pallas.paged_attention(q, k_pages, v_pages, metadata, backend="xla")

    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros(q.shape[0], jnp.int32),  # unused by attention itself
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=case.max_query_len,
    )
    ref = paged_attention_reference(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, max_query_len=case.max_query_len
    )
    assert rel_err(step(q, k_pages, v_pages, metadata), ref) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: dict(prefill_tile=0), "prefill_tile must be >= 1"),
        (lambda a: dict(decode_chunk_pages=0), "decode_chunk_pages must be >= 1"),
        (lambda a: dict(max_query_len=0), "max_query_len must be >= 1"),
        (lambda a: dict(q=a["q"][:, :7]), "must be a multiple of the pages' 3"),
        (lambda a: dict(k_pages=a["k_pages"].astype(jnp.bfloat16)), "share a dtype"),
        (lambda a: dict(v_pages=a["v_pages"][:, :, :, :32]), "must both be"),
        (lambda a: dict(seq_lens=a["seq_lens"].astype(jnp.float32)), "seq_lens must be int32"),
        (lambda a: dict(query_start_loc=a["query_start_loc"][:4]), r"query_start_loc \[num_seqs \+ 1\]"),
        (lambda a: dict(layout="block_major"), "kv_layout must be one of"),
    ],
)
def test_rejects_bad_arguments(change, message):
    q, k_pages, v_pages, block_tables, seq_lens, query_start_loc = make_inputs(Case(**MIXED))
    args = dict(
        q=q, k_pages=k_pages, v_pages=v_pages, block_tables=block_tables, seq_lens=seq_lens,
        query_start_loc=query_start_loc, max_query_len=64,
    )
    with pytest.raises(ValueError, match=message):
        paged_attention_xla(**{**args, **change(args)})
