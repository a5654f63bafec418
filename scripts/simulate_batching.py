"""Why paged KV memory: static vs continuous batching, and prefix sharing, counted on the real block
pool and page tables (no model, no attention).

    python scripts/simulate_batching.py --out-dir out/
"""

import argparse
import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from kernels_pallas.layout import bytes_per_block
from paged_jax.core import block_pool
from paged_jax.research import page_table
from paged_jax.research import simulate
from paged_jax.research.page_table import blocks_for_tokens


def static_batching_efficiency(output_lengths: list[int]) -> tuple[int, int]:
    """(useful token slots, reserved token slots) of one batch padded to its longest request."""
    return sum(output_lengths), len(output_lengths) * max(output_lengths)


def static_blocks_in_use(output_lengths: list[int], block_size: int) -> np.ndarray:
    """int [steps]: blocks held at each step when every request reserves the longest length up front."""
    reserved = len(output_lengths) * blocks_for_tokens(max(output_lengths), block_size)
    return np.full(max(output_lengths), reserved)


def continuous_blocks_in_use(output_lengths: list[int], block_size: int) -> np.ndarray:
    """int [steps]: blocks in use at each step when blocks are taken on demand and freed at finish.

    All requests start at step 1 with no prompt and generate one token a step; a step's count is
    taken after its appends, before the requests that finished in it are released (simulate.py).
    """
    num_seqs, steps = len(output_lengths), max(output_lengths)
    max_blocks = blocks_for_tokens(steps, block_size)
    none = jnp.zeros(num_seqs, jnp.int32)
    workload = simulate.Workload(prompt_lens=none, output_lens=jnp.array(output_lengths, jnp.int32),
                                 arrival_steps=none, reserve_tokens=none)
    # A pool that holds every request at its longest, so nothing is ever preempted.
    result = simulate.simulate(workload, num_blocks=1 + num_seqs * max_blocks, block_size=block_size,
                               max_blocks_per_seq=max_blocks, num_steps=steps, max_running=num_seqs)
    if int(simulate.oom_events(result)):
        raise RuntimeError("block pool ran out; it is sized to hold every request")
    return np.asarray(result.blocks_in_use)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixSharing:
    prompt_blocks: int  # blocks one copy of the system prompt fills
    blocks_unshared: int  # blocks the conversations would hold with private prompts
    blocks_shared: int  # blocks in use once the prompt is shared
    references: int  # sum of the shared blocks' reference counts
    copies: int  # copy-on-write copies made when each conversation writes its first own token
    blocks_after_first_token: int


def prefix_sharing(num_conversations: int, prompt_len: int, block_size: int) -> PrefixSharing:
    """Prefill a system prompt once, fork it to every conversation, then let each write one token."""
    prompt_blocks = blocks_for_tokens(prompt_len, block_size)
    max_blocks = blocks_for_tokens(prompt_len + 1, block_size)
    table = page_table.init_page_table(num_conversations, max_blocks, block_size)
    pool = block_pool.init_pool(1 + num_conversations * max_blocks)
    rows = jnp.arange(num_conversations, dtype=jnp.int32)
    table, pool, prefilled = page_table.append_tokens(table, pool, rows[:1], jnp.array([prompt_len]))
    table, pool, forked = page_table.fork(table, pool, rows[0], rows[1:])
    blocks_shared, references = int(block_pool.num_in_use(pool)), int(jnp.sum(pool.refcounts))
    table, pool, copies, unshared = page_table.unshare_last_blocks(table, pool, rows)
    table, pool, appended = page_table.append_tokens(table, pool, rows, jnp.ones(num_conversations, jnp.int32))
    if not (prefilled and forked and unshared and appended):
        raise RuntimeError("block pool refused a request; it is sized to hold every conversation")
    return PrefixSharing(
        prompt_blocks=prompt_blocks,
        blocks_unshared=num_conversations * prompt_blocks,
        blocks_shared=blocks_shared,
        references=references,
        copies=int(jnp.sum(copies[:, 0] >= 0)),
        blocks_after_first_token=int(block_pool.num_in_use(pool)),
    )


def blocks_in_budget(budget_bytes: int, block_bytes: int) -> int:
    return budget_bytes // block_bytes


def plot_blocks_in_use(static: np.ndarray, continuous: np.ndarray, block_size: int, path: pathlib.Path) -> None:
    """static, continuous: int [steps], blocks in use at each step."""
    # A bare Figure renders with Agg: no GUI backend, no pyplot global state.
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    steps = np.arange(1, static.size + 1)
    ax.step(steps, static, where="post", label="static: every request reserves the longest length")
    ax.step(steps, continuous, where="post", label="continuous: blocks on demand, freed at finish")
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"KV blocks in use (block_size {block_size})")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("."), help="where the PNG goes")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output-lengths", type=int, nargs="+", default=[32, 128, 64, 256])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--memory-gb", type=int, default=60, help="KV memory budget, in GB and in GiB")
    args = parser.parse_args(argv)
    lengths, bs = args.output_lengths, args.block_size

    useful, reserved = static_batching_efficiency(lengths)
    print(f"Static batching: output lengths {', '.join(map(str, lengths))} padded to {max(lengths)}")
    print(f"  useful token slots {useful:,} of {reserved:,} reserved ({useful / reserved:.1%})")

    static, continuous = static_blocks_in_use(lengths, bs), continuous_blocks_in_use(lengths, bs)
    print(f"\nKV blocks in use per step (block_size {bs}, output tokens only, {static.size} steps)")
    print(f"  {'allocation':<40}{'peak':>6}{'mean':>8}")
    for name, blocks in [
        (f"static (each reserves {max(lengths)} tokens)", static),
        ("continuous (on demand, freed at finish)", continuous),
    ]:
        print(f"  {name:<40}{blocks.max():>6}{blocks.mean():>8.2f}")

    shared = prefix_sharing(args.conversations, args.prompt_len, bs)
    full, rest = divmod(args.prompt_len, bs)
    partial = f" + 1 partial holding {rest} tokens" if rest else ""
    print(f"\nPrefix sharing: {args.conversations} conversations, {args.prompt_len}-token system prompt")
    print(f"  ({shared.prompt_blocks} blocks per copy: {full} full{partial})")
    print(f"  {'blocks without sharing':<40}{shared.blocks_unshared:>6}")
    print(f"  {'blocks with share()':<40}{shared.blocks_shared:>6}   refcounts sum to {shared.references}")
    print(
        f"  {'after each writes its first token':<40}{shared.blocks_after_first_token:>6}"
        f"   {shared.copies} copy-on-write copies of the partial block"
    )

    block_bytes = bytes_per_block(32, bs, 8, 128, jnp.float16)
    gb, gib = args.memory_gb * 10**9, args.memory_gb * 2**30
    print(f"\nKV memory: 32 layers, 8 KV heads, head_dim 128, float16, block_size {bs}")
    print(f"  {'bytes per block':<40}{block_bytes:>14,}")
    print(f"  {f'blocks in {args.memory_gb} GB  ({gb:,} bytes)':<40}{blocks_in_budget(gb, block_bytes):>14,}")
    print(f"  {f'blocks in {args.memory_gb} GiB ({gib:,} bytes)':<40}{blocks_in_budget(gib, block_bytes):>14,}")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "blocks_in_use.png"
    plot_blocks_in_use(static, continuous, bs, path)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
