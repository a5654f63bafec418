"""models/sharding.py on the host: when KV heads are copied, how, and which meshes are refused; and a
Gemma 3 (q/k norms, sliding layers) and a Qwen3-MoE (experts split) over forced host devices, token for
token as on one."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import sharding
from models.tiny import TINY_LLAMA


@pytest.mark.parametrize("heads, kv_heads, size, replicas", [
    (8, 2, 2, 1), (8, 2, 4, 2), (8, 2, 8, 4), (9, 3, 3, 1), (8, 8, 4, 1), (6, 2, 1, 1),
])
def test_kv_head_replicas(heads, kv_heads, size, replicas):
    config = dataclasses.replace(TINY_LLAMA, num_heads=heads, num_kv_heads=kv_heads)
    assert sharding.kv_head_replicas(config, size) == replicas
    assert sharding.with_kv_replicas(config, replicas).num_kv_heads == kv_heads * replicas


@pytest.mark.parametrize("heads, kv_heads, size, message", [
    (6, 2, 4, "divide the model's 6 query heads"),
    (12, 3, 2, "must divide the model's 3 KV heads or be a multiple"),
])
def test_meshes_that_cannot_split_the_heads_are_refused(heads, kv_heads, size, message):
    config = dataclasses.replace(TINY_LLAMA, num_heads=heads, num_kv_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        sharding.kv_head_replicas(config, size)


def test_copied_kv_heads_keep_the_query_heads_in_order():
    """[hidden, kv, group + 2, dim] with 2 KV heads of 4 query heads each, copied twice: each copy has 2
    of its head's query heads, in order, and the head's own k and v."""
    hidden, kv, group, dim = 3, 2, 4, 5
    qkv = np.random.default_rng(0).normal(size=(hidden, kv, group + 2, dim))
    out = sharding.replicate_kv_heads(qkv, 2)
    assert out.shape == (hidden, 4, 4, dim)
    q_in = qkv[:, :, :group].reshape(hidden, kv * group, dim)
    q_out = out[:, :, :2].reshape(hidden, kv * group, dim)
    np.testing.assert_array_equal(q_out, q_in)
    for copy in range(4):
        np.testing.assert_array_equal(out[:, copy, 2:], qkv[:, copy // 2, group:])
    bias = qkv[0]  # [kv, group + 2, dim], as qkv_bias is
    np.testing.assert_array_equal(sharding.replicate_kv_heads(bias, 2), out[0])


# Runs in a subprocess: XLA_FLAGS must force the host devices before JAX starts.
_TP_RUN = """
import json, numpy as np
from models import tiny
from paged_jax import LLM, EngineConfig, LLMEngine, SamplingParams
config = getattr(tiny, {config!r})
prompts = [np.random.default_rng(i).integers(2, 320, n).tolist() for i, n in enumerate((5, 19, 30))]
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
tokens = {{}}
for size in (1, 2, 4):
    engine = LLMEngine(tiny.random_model(config), config, None, EngineConfig(
        tensor_parallel_size=size, block_size=8, num_blocks=64, max_num_batched_tokens=16))
    tokens[size] = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)]
print(json.dumps(tokens))
"""


def tokens_over_1_2_and_4_devices(config: str) -> dict[str, list[list[int]]]:
    """Greedy tokens of models.tiny's `config` (a random model) on 1, 2 and 4 forced host devices."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    run = subprocess.run([sys.executable, "-c", _TP_RUN.format(config=config)],
                         cwd=Path(__file__).resolve().parents[2],
                         env=os.environ | {"XLA_FLAGS": flags}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_gemma3_over_2_and_4_devices_matches_one():
    """2 devices split the 2 KV heads (and their q/k norms' inputs), 4 copy each twice; the sliding
    layers' windows (8, the prompts pass it) and chunked prefill in play."""
    tokens = tokens_over_1_2_and_4_devices("TINY_GEMMA3")
    assert tokens["2"] == tokens["1"] and tokens["4"] == tokens["1"]


def test_qwen3_moe_over_2_and_4_devices_matches_one():
    """Every expert split over its intermediate axis (as the dense MLP of the layer between), the
    router on every device: the same experts chosen for every token, and the same tokens."""
    tokens = tokens_over_1_2_and_4_devices("TINY_QWEN3_MOE")
    assert tokens["2"] == tokens["1"] and tokens["4"] == tokens["1"]
