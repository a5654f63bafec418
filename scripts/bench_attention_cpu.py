"""Decode attention on the CPU: the jnp reference against alternative XLA formulations.

    python scripts/bench_attention_cpu.py --num-seqs 64 --context 600

Prints the median time of each variant and its error against the reference. The alternatives live
here, not in the library, until one of them wins.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import layout
from kernels_pallas.reference import paged_attention_reference


def decode_dense(q, k_pages, v_pages, block_tables, seq_lens):
    """The reference's math for one token per sequence, without its ragged gather/scatter of q."""
    num_seqs, num_heads, dim = q.shape
    kvh = k_pages.shape[2]
    k = layout.gather_kv(k_pages, block_tables).astype(jnp.float32)  # [S, K, KVH, D]
    v = layout.gather_kv(v_pages, block_tables).astype(jnp.float32)
    valid = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]  # [S, K]
    v = jnp.where(valid[:, :, None, None], v, 0.0)
    qs = q.astype(jnp.float32).reshape(num_seqs, kvh, num_heads // kvh, dim) * dim**-0.5
    scores = jnp.where(valid[:, None, None], jnp.einsum("shgd,skhd->shgk", qs, k), -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("shgk,skhd->shgd", p, v).reshape(q.shape).astype(q.dtype)


def decode_chunked(q, k_pages, v_pages, block_tables, seq_lens, pages_per_chunk=8):
    """Online softmax over chunks of block-table columns: gathers a chunk at a time, never all K/V."""
    num_seqs, num_heads, dim = q.shape
    _, block_size, kvh, _ = k_pages.shape
    group = num_heads // kvh
    chunk = pages_per_chunk * block_size
    pad = -block_tables.shape[1] % pages_per_chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, pad))).reshape(num_seqs, -1, pages_per_chunk)
    qs = q.astype(jnp.float32).reshape(num_seqs, kvh, group, dim) * dim**-0.5

    def step(carry, i):
        acc, m, l = carry  # [S, KVH, G, D], [S, KVH, G, 1], [S, KVH, G, 1]
        k = k_pages[tables[:, i]].reshape(num_seqs, chunk, kvh, dim).astype(jnp.float32)
        v = v_pages[tables[:, i]].reshape(num_seqs, chunk, kvh, dim).astype(jnp.float32)
        valid = i * chunk + jnp.arange(chunk)[None, :] < seq_lens[:, None]  # [S, C]
        v = jnp.where(valid[:, :, None, None], v, 0.0)
        s = jnp.where(valid[:, None, None], jnp.einsum("shgd,skhd->shgk", qs, k), -1e30)
        m_new = jnp.maximum(m, s.max(-1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        return (alpha * acc + jnp.einsum("shgk,skhd->shgd", p, v), m_new, alpha * l + p.sum(-1, keepdims=True)), None

    init = (jnp.zeros_like(qs), jnp.full(qs.shape[:-1] + (1,), -1e30), jnp.zeros(qs.shape[:-1] + (1,)))
    (acc, _, l), _ = jax.lax.scan(step, init, jnp.arange(tables.shape[1]))
    return (acc / jnp.maximum(l, 1e-30)).reshape(q.shape).astype(q.dtype)


def decode_sdpa(q, k_pages, v_pages, block_tables, seq_lens):
    """jax.nn.dot_product_attention (XLA implementation) over gathered K/V, V masked for NaN safety."""
    k = layout.gather_kv(k_pages, block_tables)
    v = layout.gather_kv(v_pages, block_tables)
    v = jnp.where((jnp.arange(v.shape[1])[None, :] < seq_lens[:, None])[:, :, None, None], v, 0)
    out = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=seq_lens, implementation="xla")
    return out[:, 0]


def median_seconds(f, args, repeats):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    s, bs = args.num_seqs, args.block_size
    max_blocks = -(-args.context // bs)
    num_blocks = s * max_blocks
    shape = layout.page_shape(num_blocks, bs, args.num_kv_heads, args.head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    block_tables = jnp.asarray(rng.permutation(num_blocks).reshape(s, max_blocks), jnp.int32)
    seq_lens = jnp.asarray(rng.integers(args.context // 2, args.context + 1, s), jnp.int32)
    q = jnp.asarray(rng.standard_normal((s, args.num_heads, args.head_dim)), dtype)
    inputs = (q, k_pages, v_pages, block_tables, seq_lens)
    kv_bytes = 2 * int(seq_lens.sum()) * args.num_kv_heads * args.head_dim * dtype.itemsize
    print(f"{s} seqs, context <= {args.context}, {args.dtype}: {kv_bytes / 1e6:.1f} MB of live K/V per call")

    reference = jax.jit(
        lambda q, k, v, bt, sl: paged_attention_reference(
            q, k, v, bt, sl, jnp.arange(s + 1, dtype=jnp.int32), max_query_len=1
        )
    )
    expected = np.asarray(reference(*inputs), np.float64)
    variants = dict(reference=reference, decode_dense=jax.jit(decode_dense), sdpa_xla=jax.jit(decode_sdpa))
    for pages in (1, 2, 4, 8):
        variants[f"chunked_{pages}_pages"] = jax.jit(lambda *a, p=pages: decode_chunked(*a, pages_per_chunk=p))
    for name, f in variants.items():
        seconds = median_seconds(f, inputs, args.repeats)
        err = np.linalg.norm(np.asarray(f(*inputs), np.float64) - expected) / np.linalg.norm(expected)
        print(f"{name:>18}: {seconds * 1e3:7.2f} ms  {kv_bytes / seconds / 1e9:5.1f} GB/s  rel err {err:.1e}")


if __name__ == "__main__":
    main()
