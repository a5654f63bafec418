"""Decode attention alone, the C++ kernel (kernels_pallas/cpu/attention.cc) at the models' shapes, against
the same kernel at another git revision, side by side in one process.

    python scripts/bench_decode_attention.py --against main        # this tree's kernel against main's
    python scripts/bench_decode_attention.py --only tiny --rounds 8

Shapes (one layer; head-major pages, as the engine lays them out for this kernel; float32 pages unless
--dtype bfloat16; contexts drawn around --context, ragged), each three times: a sequence's pages in
random order across the pool, in order (as a prompt's blocks come from the block manager's queue), and
in step (contexts all --context long, block j of sequence i at j * sequences + i, as sequences
decoding in step take theirs), since jumps between pages of a few kB cost the kernel as much as its
arithmetic at the tiny model's shape:
- tiny: bench_overlap.py's model (6 query heads over 2 KV heads, head_dim 16) with its blocks of 16, at
  256 and 64 sequences;
- smollm2: SmolLM2-135M (9 over 3, head_dim 64), blocks of 64 (the engine's default for this kernel);
- gemma3: Gemma 3 270M (4 over 1, head_dim 256), blocks of 64, a full-attention layer.
The other revision's attention.cc and common.h are compiled into a library of their own, registered
under a second FFI target, so both kernels run on the same inputs, interleaved (a loaded machine slows
them alike). Prints each one's median ms a call, its K/V read rate (the step's live K/V bytes over that
time), the ratio, and the largest difference between the two outputs.
"""

import argparse
import ctypes
import dataclasses
import functools
import hashlib
import itertools
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import layout
from kernels_pallas.cpu import attention, library


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_seqs: int


SHAPES = (
    Shape("tiny 256", 6, 2, 16, 16, 256),
    Shape("tiny 64", 6, 2, 16, 16, 64),
    Shape("smollm2 64", 9, 3, 64, 64, 64),
    Shape("gemma3 16", 4, 1, 256, 64, 16),
)


@functools.cache
def register_revision(revision: str | None) -> str:
    """The FFI target of attention.cc at git `revision`, or as this tree has it (None): built alone,
    loaded and registered once."""
    here = Path(library.__file__).parent
    if revision is None:
        sources = {name: (here / name).read_bytes() for name in ("attention.cc", "common.h")}
    else:
        sources = {name: subprocess.run(["git", "-C", str(here), "show", f"{revision}:./{name}"], capture_output=True,
                                        check=True).stdout for name in ("attention.cc", "common.h")}
    key = hashlib.sha256(b"".join(sources.values())).hexdigest()[:12]
    out = library._cache_dir() / f"attention-{key}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in sources.items():
                (Path(tmp) / name).write_bytes(text)
            subprocess.run(["g++", *library._COMPILE_FLAGS, "-w", f"-I{jax.ffi.include_dir()}", *library._LINK_FLAGS,
                            str(Path(tmp) / "attention.cc"), "-o", str(out)], check=True)
    target = f"paged_jax_paged_attention_cpu_{key}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(ctypes.cdll.LoadLibrary(str(out)).PagedAttentionCpu),
                                platform="cpu")
    return target


def kernel_call(target: str, kv_layout: str):
    """A jitted decode-attention call through the FFI target `target` (attention.py's arguments)."""

    @jax.jit
    def call(q, k_pages, v_pages, tables, lens, starts):
        fn = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
        return fn(q, k_pages, v_pages, tables, lens, starts, scale=np.float32(q.shape[-1] ** -0.5),
                  sliding_window=np.int64(0), soft_cap=np.float32(0.0),
                  **attention.layout_attributes(k_pages, kv_layout))

    return call


ORDERS = ("random", "in order", "in step")


def make_inputs(shape: Shape, context: int, dtype, rng, order: str):
    """A decode step of shape.num_seqs sequences of about `context` tokens, pages in random order,
    each sequence's in order, or "in step": every sequence exactly `context` long, its block j the
    j-th of its batch's j-th blocks, as sequences decoding in step take their blocks one after another
    (bench_overlap.py's --model)."""
    lens = rng.integers(context - context // 8, context + context // 8 + 1, shape.num_seqs).astype(np.int32)
    if order == "in step":
        lens[:] = context
    blocks = -(-lens // shape.block_size)
    num_blocks = int(blocks.sum()) + 1
    pages = layout.page_shape(num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, layout.HEAD_MAJOR)
    k = jnp.asarray(rng.standard_normal(pages, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(pages, np.float32), dtype)
    tables = np.zeros((shape.num_seqs, int(blocks.max())), np.int32)
    if order == "in step":
        tables[:] = (np.arange(int(blocks.max()))[None] * shape.num_seqs + np.arange(shape.num_seqs)[:, None]).astype(np.int32)
    else:
        free = rng.permutation(num_blocks) if order == "random" else np.arange(num_blocks)
        for i, n in enumerate(blocks):
            tables[i, :n], free = free[:n], free[n:]
    q = jnp.asarray(rng.standard_normal((shape.num_seqs, shape.num_heads, shape.head_dim), np.float32))
    starts = np.arange(shape.num_seqs + 1, dtype=np.int32)
    return (q, k, v, jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(starts))


def median_ms(fns: dict, inputs, rounds: int, calls: int = 10) -> dict[str, float]:
    """Median ms a call of each function, turns of `calls` calls interleaved over `rounds` rounds."""
    times = {name: [] for name in fns}
    for f in fns.values():
        jax.block_until_ready(f(*inputs))
    for _ in range(rounds):
        for name, f in fns.items():
            for _ in range(calls):
                start = time.perf_counter()
                jax.block_until_ready(f(*inputs))
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: float(np.median(t)) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", help="the git revision whose kernel is the baseline")
    parser.add_argument("--context", type=int, default=250, help="tokens a sequence holds, about (ragged +-1/8)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", help="the shapes whose name contains this")
    args = parser.parse_args()
    if not library.available():
        raise SystemExit(f"the CPU kernel is not built: {library.build_error()}")
    fns = {args.against: kernel_call(register_revision(args.against), layout.HEAD_MAJOR),
           "this tree": kernel_call(register_revision(None), layout.HEAD_MAJOR)}
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    print(f"decode attention, one layer, head-major {args.dtype} pages, contexts about {args.context}; "
          f"medians of {10 * args.rounds} calls")
    print(f"{'shape':>12} {'pages':>8} {args.against[:10]:>10} {'GB/s':>6} {'this tree':>10} {'GB/s':>6} {'ratio':>6}"
          "  max diff")
    for shape, order in itertools.product(SHAPES, ORDERS):
        if args.only and args.only not in shape.name:
            continue
        inputs = make_inputs(shape, args.context, dtype, rng, order)
        ms = median_ms(fns, inputs, args.rounds)
        kv_bytes = 2 * int(inputs[4].sum()) * shape.num_kv_heads * shape.head_dim * dtype.itemsize
        before, after = ms[args.against], ms["this tree"]
        diff = float(jnp.max(jnp.abs(fns[args.against](*inputs) - fns["this tree"](*inputs))))
        print(f"{shape.name:>12} {order:>8} {before:10.3f} {kv_bytes / before / 1e6:6.1f} {after:10.3f}"
              f" {kv_bytes / after / 1e6:6.1f} {before / after:5.2f}x  {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
