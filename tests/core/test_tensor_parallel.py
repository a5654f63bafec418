"""Tensor parallelism on forced host devices: the same greedy tokens as one device, with chunked prefill,
prefix caching and preemption in play; weights and pages split as models/sharding.py says; the
compiled step's collectives; the sharded step lowered for CUDA with the Pallas kernel.

The engines run in one subprocess (tensor_parallel_run.py): XLA_FLAGS must force the devices before
JAX starts, and this process's JAX has started already.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tensor_parallel_run as tp  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def run_forced(code: str, devices: int, timeout: float) -> str:
    """stdout of `code` run with tests/ importable on `devices` forced host devices."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    env = os.environ | {"XLA_FLAGS": flags}
    run = subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = ['tests/core']; " + code], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


@pytest.fixture(scope="module")
def results() -> dict:
    runs = ", ".join(map(repr, tp.RUNS))
    out = run_forced(f"import tensor_parallel_run; tensor_parallel_run.main([{runs}])", 4, timeout=600)
    return json.loads(out.strip().splitlines()[-1])


def test_cpu_kernel_on_busy_host_devices_finishes():
    # About 3 s when it works; it used to hang (a SmolLM2 run on 3 devices never finished).
    out = run_forced("import tensor_parallel_run; print(tensor_parallel_run.busy_devices())", 3, timeout=120)
    assert int(out.split()[-1]) >= tp.PARAMS.max_tokens


def reference(name: str) -> str:
    """The single-device run of the same model and options."""
    return re.sub(r"tp\d", "tp1", name)


@pytest.mark.parametrize("name", [n for n in tp.RUNS if reference(n) != n])
def test_greedy_tokens_match_one_device(results, name):
    got, want = results[name], results[reference(name)]
    tp.assert_same_tokens(got, want, swap=name.endswith("swap"))
    # The same buckets compile the same programs: the mesh adds no recompiles.
    assert got["compiles"] == want["compiles"]


@pytest.mark.parametrize("name, kv_heads, qkv_shard, pages_shard", [
    # 2 devices split the 2 KV heads: one head's q/k/v group (4 query heads, k, v) each.
    ("kv2-tp2", 2, [64, 1, 6, 16], [14, 8, 1, 16]),
    # 4 devices copy each of the 2 KV heads twice: one copy with 2 of its 4 query heads each.
    ("kv2-tp4", 4, [64, 1, 4, 16], [14, 8, 1, 16]),
    ("kv3-tp3", 3, [64, 1, 5, 16], [14, 8, 1, 16]),
    ("kv2-tp2-head_major", 2, [64, 1, 6, 16], [14, 1, 8, 16]),
])
def test_each_device_holds_its_heads(results, name, kv_heads, qkv_shard, pages_shard):
    run = results[name]
    assert run["kv_heads"] == kv_heads
    assert run["qkv_shard"] == qkv_shard
    assert run["pages_shard"] == pages_shard


@pytest.mark.parametrize("name", ["kv2-tp2", "kv2-tp4", "kv3-tp3"])
def test_step_all_reduces_activations_and_gathers_no_weight(results, name):
    run = results[name]
    config = tp.CONFIGS[tp.RUNS[name][0]]
    ops = run["collectives"]
    hidden = [shape for op, shape in ops if op == "all-reduce" and shape[-1:] == [config.hidden_size] and len(shape) == 2]
    # o and down in every layer, and the embedding lookup where the vocabulary is split (320 tokens
    # split over 2 or 4 devices; over 3 the table is replicated and the lookup is local).
    size = int(name.split("tp")[1])
    assert len(hidden) == 2 * config.num_layers + (config.vocab_size % size == 0), ops
    weights = {tuple(shape) for shape in run["param_shapes"]}
    assert not [shape for op, shape in ops if op == "all-gather" and tuple(shape) in weights], ops
    assert results[reference(name)]["collectives"] == []


def test_bench_throughput_finds_the_collectives_time(results):
    assert results["collective_ms"] > 0


def test_sharded_step_lowers_for_cuda_with_the_pallas_kernel(results):
    cuda = results["cuda"]
    assert cuda["backend"] == "pallas" and cuda["triton"], "the step must call the Pallas Triton kernel"
    assert cuda["manual"], "attention runs per device under shard_map"
    assert cuda["local_pages"] > 0, "the kernel reads one device's pages: 1 of the 4 KV heads"
    assert cuda["donated"] == 2 * tp.CONFIGS["kv2"].num_layers, "the KV cache is donated"


SMOLLM2_TP = """
import json, sys
from paged_jax import LLM, SamplingParams
prompts = ["The capital of France is", "PagedAttention keeps the KV cache in"]
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
tokens = {}
for size in (1, 3):
    llm = LLM("smollm2-135m", tensor_parallel_size=size, num_blocks=64, max_num_seqs=2)
    tokens[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps(tokens))
"""


def test_smollm2_on_three_devices_gives_the_one_device_tokens():
    """The real model, whose 9 query and 3 KV heads split 3 ways (one KV head per device)."""
    env = os.environ | {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"}
    run = subprocess.run([sys.executable, "-c", SMOLLM2_TP], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    tokens = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(tokens["1"]) == 2 and all(len(t) == 12 for t in tokens["1"])
    assert tokens["3"] == tokens["1"]
