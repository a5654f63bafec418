"""What EngineConfig's defaults resolve to per platform, with fake devices standing in for a GPU."""

import types

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import bytes_per_block, default_backend
from models.tiny import TINY_LLAMA
from paged_jax.core.config import EngineConfig
from paged_jax.core.resolve import HOST_KV_CACHE_MEMORY_BYTES, default_device, default_dtype, resolve

MiB = 1 << 20


def fake_device(platform: str, stats=None):
    return types.SimpleNamespace(platform=platform, memory_stats=lambda: stats)


def per_block(dtype, block_size=16) -> int:
    c = TINY_LLAMA
    return bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, dtype)


def test_auto_on_a_gpu_is_bfloat16_pallas_and_a_budget_from_free_memory():
    gpu = fake_device("gpu", {"bytes_limit": 20 * MiB, "bytes_in_use": 2 * MiB, "peak_bytes_in_use": 3 * MiB})
    assert default_dtype("gpu") == "bfloat16"
    resolved = resolve(EngineConfig(), TINY_LLAMA, gpu, jnp.bfloat16)
    assert (resolved.dtype, resolved.attention_backend, resolved.platform) == ("bfloat16", "pallas", "gpu")
    assert (resolved.block_size, resolved.kv_layout) == (16, "token_major")
    # 0.9 of what the allocator may hold, less the weights already in it; block 0 is the null block.
    assert resolved.num_blocks == (int(0.9 * 20 * MiB) - 2 * MiB) // per_block(jnp.bfloat16) + 1
    half = resolve(EngineConfig(gpu_memory_utilization=0.5), TINY_LLAMA, gpu, jnp.bfloat16)
    assert half.num_blocks == (10 * MiB - 2 * MiB) // per_block(jnp.bfloat16) + 1


def test_auto_on_the_cpu_stays_float32_and_two_gib():
    assert default_dtype("cpu") == "float32"
    resolved = resolve(EngineConfig(max_num_seqs=8192), TINY_LLAMA, fake_device("cpu"), jnp.float32)
    assert resolved.dtype == "float32" and resolved.platform == "cpu"
    assert resolved.attention_backend == default_backend(jnp.float32, "cpu") in ("cpu", "xla")
    # The C++ kernel reads whole head-major blocks of 64 fastest; the XLA path is sized for 16 token-major.
    expected = (64, "head_major") if resolved.attention_backend == "cpu" else (16, "token_major")
    assert (resolved.block_size, resolved.kv_layout) == expected
    assert resolved.num_blocks == HOST_KV_CACHE_MEMORY_BYTES // per_block(jnp.float32, resolved.block_size) + 1


def test_block_size_and_layout_follow_the_attention_backend_unless_asked():
    cpu = fake_device("cpu")
    xla = resolve(EngineConfig(attention_backend="xla", num_blocks=8), TINY_LLAMA, cpu, jnp.float32)
    assert (xla.block_size, xla.kv_layout) == (16, "token_major")
    asked = resolve(EngineConfig(block_size=32, kv_layout="token_major", num_blocks=8), TINY_LLAMA, cpu, jnp.float32)
    assert (asked.block_size, asked.kv_layout) == (32, "token_major")
    assert asked.max_blocks_per_seq == -(-asked.max_model_len // 32)


def test_explicit_choices_win():
    gpu = fake_device("gpu", {"bytes_limit": 20 * MiB, "bytes_in_use": 2 * MiB})
    by_bytes = resolve(EngineConfig(kv_cache_memory_bytes=MiB, dtype="float32"), TINY_LLAMA, gpu, jnp.bfloat16)
    assert by_bytes.dtype == "float32" and by_bytes.num_blocks == MiB // per_block(jnp.float32) + 1
    by_count = resolve(EngineConfig(num_blocks=33, kv_cache_memory_bytes=MiB, attention_backend="xla"),
                       TINY_LLAMA, gpu, jnp.bfloat16)
    assert by_count.num_blocks == 33 and by_count.attention_backend == "xla"


def test_a_gpu_without_memory_stats_falls_back_to_the_host_budget():
    resolved = resolve(EngineConfig(max_num_seqs=8192), TINY_LLAMA, fake_device("gpu", None), jnp.bfloat16)
    assert resolved.num_blocks == HOST_KV_CACHE_MEMORY_BYTES // per_block(jnp.bfloat16) + 1


def test_a_full_gpu_and_a_backend_of_another_platform_are_errors():
    full = fake_device("gpu", {"bytes_limit": 20 * MiB, "bytes_in_use": 19 * MiB})
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        resolve(EngineConfig(), TINY_LLAMA, full, jnp.bfloat16)
    with pytest.raises(ValueError, match="'pallas' runs on gpu only"):
        resolve(EngineConfig(attention_backend="pallas"), TINY_LLAMA, fake_device("cpu"), jnp.float32)
    with pytest.raises(ValueError, match="'cpu' runs on cpu only"):
        resolve(EngineConfig(attention_backend="cpu", num_blocks=8), TINY_LLAMA, fake_device("gpu"), jnp.float32)
    interpreted = resolve(EngineConfig(attention_backend="pallas_interpret", num_blocks=8), TINY_LLAMA,
                          fake_device("cpu"), jnp.float32)
    assert interpreted.attention_backend == "pallas_interpret"


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_kv_layout_is_one_of_the_layouts():
    assert EngineConfig(kv_layout="head_major").kv_layout == "head_major"
    with pytest.raises(ValueError, match=r"kv_layout must be one of \('auto', 'token_major', 'head_major'\)"):
        EngineConfig(kv_layout="head-major")


def test_default_device_follows_jax_default_device():
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        assert default_device() == cpu
    with jax.default_device("cpu"):
        assert default_device() == cpu
    assert default_device() == jax.devices()[0]


def test_tensor_parallel_budget_is_per_gpu_and_shared_on_the_host():
    """Each of 2 GPUs holds one of TINY_LLAMA's 2 KV heads, so the same budget buys twice the blocks;
    devices on the host share its memory, and its budget."""
    gpu = fake_device("gpu", {"bytes_limit": 20 * MiB, "bytes_in_use": 2 * MiB})
    one = resolve(EngineConfig(), TINY_LLAMA, gpu, jnp.bfloat16)
    two = resolve(EngineConfig(tensor_parallel_size=2), TINY_LLAMA, gpu, jnp.bfloat16)
    assert two.num_blocks - 1 == (int(0.9 * 20 * MiB) - 2 * MiB) // (per_block(jnp.bfloat16) // 2)
    assert two.num_blocks - 1 >= 2 * (one.num_blocks - 1)
    host = [resolve(EngineConfig(max_num_seqs=8192, tensor_parallel_size=n), TINY_LLAMA, fake_device("cpu"), jnp.float32)
            for n in (1, 2)]
    for resolved in host:
        assert resolved.num_blocks == HOST_KV_CACHE_MEMORY_BYTES // per_block(jnp.float32, resolved.block_size) + 1
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_matmul_backend_packs_for_float32_on_one_cpu_device_and_says_why_not_elsewhere():
    def matmul(platform, dtype=jnp.float32, **config):
        return resolve(EngineConfig(num_blocks=8, **config), TINY_LLAMA, fake_device(platform), dtype).matmul

    assert matmul("cpu") == ("cpu", "the C++ kernel over packed float32 weights on the CPU", False)
    assert matmul("cpu", matmul_backend="xla") == ("xla", "asked for", False)
    assert matmul("cpu", jnp.bfloat16) == ("xla", "the weights are bfloat16, not float32", False)
    assert matmul("cpu", tensor_parallel_size=2) == ("xla", "the weights are split over devices", False)
    assert matmul("gpu", jnp.bfloat16).backend == "xla"
    with pytest.raises(ValueError, match="matmul_backend 'cpu' cannot run here: the engine runs on gpu"):
        matmul("gpu", matmul_backend="cpu")
    with pytest.raises(ValueError, match="matmul_backend must be one of"):
        EngineConfig(matmul_backend="onednn")


@pytest.mark.parametrize("asked", ["bfloat16", "bf16"])
def test_a_bfloat16_kv_cache_under_float32_weights_holds_twice_the_tokens(asked):
    cpu = fake_device("cpu")
    budget = dict(kv_cache_memory_bytes=4 * MiB, block_size=16, max_num_seqs=8192)
    full = resolve(EngineConfig(**budget), TINY_LLAMA, cpu, jnp.float32)
    half = resolve(EngineConfig(**budget, kv_cache_dtype=asked), TINY_LLAMA, cpu, jnp.float32)
    assert (full.dtype, full.kv_cache_dtype) == ("float32", "float32")
    assert (half.dtype, half.kv_cache_dtype) == ("float32", "bfloat16")
    assert half.num_blocks - 1 == 2 * (full.num_blocks - 1) == 2 * (4 * MiB // per_block(jnp.float32))
    # The C++ kernel computes in float32 over either page dtype, so it stays where it runs at all.
    assert half.attention == (("cpu", "the C++ kernel for float32 over bfloat16 pages on the CPU", False)
                              if full.attention_backend == "cpu" else full.attention)
    gpu = fake_device("gpu", {"bytes_limit": 20 * MiB, "bytes_in_use": 0})
    assert resolve(EngineConfig(kv_cache_dtype="float32"), TINY_LLAMA, gpu, jnp.bfloat16).kv_cache_dtype == "float32"


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
