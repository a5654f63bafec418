"""Runs in a subprocess of test_tensor_parallel.py, whose XLA_FLAGS force several host devices (the
flag must be set before JAX starts): the same workload through engines of tensor_parallel_size 1, 2,
3 and 4, and what each compiled and placed, printed as one JSON line for the test to judge.
"""

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import jax

from models import sharding
from models.loader import shard_model
from models.tiny import TINY_LLAMA, random_model
from paged_jax.core import model_runner, step_programs
from paged_jax.core.config import EngineConfig
from paged_jax.core.resolve import resolve
from paged_jax.core.engine import LLMEngine
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import ScheduledSeq
from paged_jax.core.sequence import Sequence

# 8 query heads over 2 KV heads, with q/k/v biases and an lm_head of its own: 2 devices split the KV
# heads, 4 devices copy each twice. SmolLM2's shape (9 query heads over 3, tied embeddings) on 3, where
# the vocabulary (320) does not split and the embedding is replicated.
CONFIGS = {
    "kv2": dataclasses.replace(TINY_LLAMA, num_heads=8, num_kv_heads=2, qkv_bias=True),
    "kv3": dataclasses.replace(TINY_LLAMA, num_heads=9, num_kv_heads=3, tie_word_embeddings=True),
}
# name -> (config, engine options); each "tpN" run is compared with its "tp1" twin.
RUNS = {
    "kv2-tp1": ("kv2", dict()),
    "kv2-tp2": ("kv2", dict(tensor_parallel_size=2)),
    "kv2-tp4": ("kv2", dict(tensor_parallel_size=4)),
    "kv2-tp1-swap": ("kv2", dict(preemption_mode="swap")),
    # Head-major pages split over their second axis (kernels_pallas/layout.py says which).
    "kv2-tp1-head_major": ("kv2", dict(kv_layout="head_major")),
    "kv2-tp2-head_major": ("kv2", dict(tensor_parallel_size=2, kv_layout="head_major")),
    "kv2-tp4-swap": ("kv2", dict(tensor_parallel_size=4, preemption_mode="swap")),
    "kv3-tp1": ("kv3", dict(attention_backend="xla")),
    "kv3-tp3": ("kv3", dict(tensor_parallel_size=3, attention_backend="xla")),
}
# Few blocks, so sequences are preempted; a small token budget, so prompts are chunked. Token-major
# pages unless a run names its layout (the CPU's "auto" would take head-major).
OPTIONS = dict(num_blocks=14, block_size=8, max_num_batched_tokens=32, max_num_seqs=4, kv_layout="token_major")
# Prompts of 10 to 55 tokens; the last repeats the fourth's first 32 tokens (four whole blocks) and
# arrives after it has been computed, so its prefix comes from the cache.
PROMPTS = [[(13 * i + 7 * t) % 300 + 2 for t in range(10 + 9 * i)] for i in range(6)]
SHARED = PROMPTS[3][:32] + [11, 12, 13]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def collectives(engine: LLMEngine) -> list[list]:
    """[op, result shape] of every collective in the compiled step for a mixed batch of the engine."""
    engine.add_request(PROMPTS[1], PARAMS)
    engine.add_request(PROMPTS[2], PARAMS)
    scheduled = engine.scheduler.schedule().scheduled
    args, keywords = engine.runner.step_args(scheduled)
    text = step_programs.step.lower(*args, **keywords).compile().as_text()
    found = re.findall(r"= \w+\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\(",
                       text)
    return [[op, [int(d) for d in shape.split(",") if d]] for shape, op in found]


def make_engine(name: str, **extra) -> LLMEngine:
    config_name, options = RUNS[name]
    config = CONFIGS[config_name]
    return LLMEngine(random_model(config), config, None, EngineConfig(**OPTIONS | options | extra))


def run(name: str) -> dict:
    """The workload through the engine of run `name`, and what its runner compiled and placed."""
    engine = make_engine(name)
    return drive(engine) | placement(engine)


def drive(engine: LLMEngine) -> dict:
    """The workload's greedy tokens, and the counters that show what was in play."""
    compiles = engine.runner.num_compiles
    for prompt in PROMPTS:
        engine.add_request(prompt, PARAMS)
    tokens, shared_added = {}, False
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        # Once every prompt has been through the model (195 tokens).
        if engine.num_batched_tokens >= 195 and not shared_added:
            engine.add_request(SHARED, PARAMS, request_id="shared")
            shared_added = True
    stats = engine.stats()
    return dict(
        tokens=tokens,
        compiles=engine.runner.num_compiles - compiles,
        preemptions=stats.num_preemptions,
        prefix_hit_blocks=stats.prefix_cache_hit_blocks,
        free_blocks=engine.blocks.num_free + engine.blocks.num_evictable,
        num_blocks=engine.blocks.num_blocks,
    )


def assert_same_tokens(got: dict, want: dict, swap: bool) -> None:
    """Two drives of the workload sampled the same greedy tokens, with what it exercises in play on
    both sides (a swapped sequence comes back with its blocks, not from the prefix cache)."""
    assert len(got["tokens"]) == len(PROMPTS) + 1
    assert got["tokens"] == want["tokens"]
    for run in (got, want):
        assert run["preemptions"] > 0
        assert run["prefix_hit_blocks"] > 0 or swap
        assert run["free_blocks"] == run["num_blocks"] - 1, "every block back in the pool"


def placement(engine: LLMEngine) -> dict:
    runner = engine.runner
    qkv = runner.state["layers"][0]["attn"]["qkv"].get_value()
    return dict(
        kv_heads=engine.model_config.num_kv_heads,
        # What device 0 holds: its share of the q/k/v weight and of a layer's pages.
        qkv_shard=list(qkv.addressable_shards[0].data.shape),
        pages_shard=list(runner.kv_cache.k[0].addressable_shards[0].data.shape),
        param_shapes=[list(x.shape) for x in jax.tree.leaves(runner.state)],
        collectives=collectives(engine),
    )


def cuda_lowering() -> dict:
    """The kv2 model's step on 4 devices lowered for CUDA with the Pallas kernel: what the text shows."""
    config = EngineConfig(num_blocks=64, block_size=16, tensor_parallel_size=4)
    # What a GPU reports once the weights are loaded; resolution reads it as a real engine would.
    gpu = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 60 << 30, "bytes_in_use": 1 << 30})
    mesh = sharding.make_mesh(4)
    model = shard_model(random_model(CONFIGS["kv2"]), mesh)
    resolved = resolve(config, model.config, gpu, model.embed.get_value().dtype)
    runner = model_runner.ModelRunner(model, model.config, resolved, mesh)
    prompts = [SHARED, PROMPTS[5]]
    scheduled = [ScheduledSeq(Sequence(seq_id=i, request_id=str(i), token_ids=p, num_prompt_tokens=len(p), params=PARAMS,
                                       seed=i, arrival_time=0.0, block_ids=list(range(4 * i + 1, 4 * i + 5))), len(p))
                 for i, p in enumerate(prompts)]
    (graph, *arrays), keywords = runner.step_args(scheduled)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                            arrays)
    text = step_programs.step.trace(graph, *abstract, **keywords).lower(lowering_platforms=("cuda",)).as_text()
    return dict(backend=resolved.attention_backend, triton="__gpu$xla.gpu.triton" in text,
                manual="sdy.manual_computation" in text or "shard_map" in text,
                # The kernel's pages on one device: 64 blocks of 16 slots, 1 of the 4 KV heads.
                local_pages=text.count("tensor<64x16x1x16xf32>"),
                donated=len(re.findall(r"tf.aliasing_output|jax.buffer_donor", text)))


def busy_devices() -> int:
    """Four prompts of a SmolLM2-like model on 3 devices with the C++ attention kernel: steps whose
    matmuls keep XLA's intra-op threads busy while every device calls the kernel. Returns the steps run.
    (The kernel used to wait for helper tasks queued behind the other devices' calls, for ever.)"""
    config = dataclasses.replace(TINY_LLAMA, hidden_size=192, intermediate_size=512, vocab_size=1024, num_layers=4,
                                 num_heads=9, num_kv_heads=3, head_dim=64)
    engine = LLMEngine(random_model(config), config, None,
                       EngineConfig(num_blocks=200, block_size=16, max_num_seqs=4, tensor_parallel_size=3,
                                    attention_backend="cpu"))
    for i, n in enumerate((441, 338, 277, 161)):
        engine.add_request([(7 * i + 3 * t) % 300 for t in range(n)], PARAMS)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def collective_ms_per_step() -> float:
    """bench_throughput's figure for the kv2 model on 2 devices, over two prompts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_throughput

    requests = [dict(prompt_token_ids=prompt) for prompt in PROMPTS[:2]]
    return bench_throughput.collective_ms_per_step(make_engine("kv2-tp2"), requests, [PARAMS] * 2)[0]


def main(names: list[str]) -> None:
    print(json.dumps({name: run(name) for name in names} | {"cuda": cuda_lowering(),
                                                            "collective_ms": collective_ms_per_step()}))


if __name__ == "__main__":
    main(sys.argv[1:] or list(RUNS))
