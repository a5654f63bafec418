"""The engine's whole jitted step (model + sampler, KV cache donated) lowered for CUDA on this CPU
machine with the Pallas backend, for the batches the scheduler makes: layout and dtype mistakes
anywhere in the model fail here, not on a GPU."""

import re
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kernels_pallas import layout
from models.tiny import TINY_LLAMA, random_model
from paged_jax.core import model_runner, multi_step, step_programs
from paged_jax.core.config import EngineConfig
from paged_jax.core.resolve import resolve
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import ScheduledSeq
from paged_jax.core.sequence import Sequence

# What a GPU reports once the weights are loaded; resolution reads it as a real engine would.
FAKE_GPU = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": 60 << 30, "bytes_in_use": 1 << 30})
NUM_BLOCKS = 64

# (tokens already computed, new tokens) per sequence.
BATCHES = {
    "decode": [(29, 1), (16, 1), (63, 1)],
    "prefill": [(0, 20), (0, 37), (32, 9)],  # two whole prompts and a later chunk of a third
    "mixed": [(40, 1), (0, 24), (16, 5), (7, 1)],
}


def scheduled(batch: str, block_size: int) -> list[ScheduledSeq]:
    out, next_block = [], 1
    for i, (computed, new) in enumerate(BATCHES[batch]):
        total = computed + new
        seq = Sequence(seq_id=i, request_id=str(i), token_ids=[(7 * i + t) % 300 + 2 for t in range(total)],
                       num_prompt_tokens=total, params=SamplingParams(temperature=0.0), seed=i, arrival_time=0.0)
        num_blocks = -(-total // block_size)
        seq.block_ids = list(range(next_block, next_block + num_blocks))
        seq.num_computed_tokens = computed
        next_block += num_blocks
        out.append(ScheduledSeq(seq, new))
    return out


def lower_step_for_cuda(batch: str, block_size: int, weights_dtype, dtype: str = "auto",
                        kv_layout: str = layout.TOKEN_MAJOR):
    """The engine's jitted step and its arguments for this batch, lowered for CUDA: (text, runner)."""
    config = EngineConfig(block_size=block_size, num_blocks=NUM_BLOCKS, dtype=dtype, kv_layout=kv_layout)
    resolved = resolve(config, TINY_LLAMA, FAKE_GPU, weights_dtype)
    assert resolved.attention_backend == "pallas"
    runner = model_runner.ModelRunner(random_model(dtype=weights_dtype), TINY_LLAMA, resolved)
    (graph, *arrays), keywords = runner.step_args(scheduled(batch, block_size))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
    lowered = step_programs.step.trace(graph, *abstract, **keywords).lower(lowering_platforms=("cuda",))
    return lowered.as_text(), resolved


def kv_cache_args(text: str, resolved, block_size: int, kv_layout: str = layout.TOKEN_MAJOR) -> list[str]:
    """The attributes of the step's KV-cache parameters in the lowered module's main signature."""
    c = TINY_LLAMA
    mlir_dtype = {"float32": "f32", "bfloat16": "bf16"}[resolved.dtype]
    shape = layout.page_shape(NUM_BLOCKS, block_size, c.num_kv_heads, c.head_dim, kv_layout)
    page = f"tensor<{'x'.join(map(str, shape))}x{mlir_dtype}>"
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    return re.findall(rf"%arg\d+: {re.escape(page)}\s*(\{{[^}}]*\}})?", main)


# Head-major pages at one block size: the layout changes the pages' shape and the kernel's indices,
# not what block size does.
@pytest.mark.parametrize("block_size, kv_layout", [(16, layout.TOKEN_MAJOR), (32, layout.TOKEN_MAJOR),
                                                   (16, layout.HEAD_MAJOR)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_whole_step_lowers_for_cuda_with_the_pallas_kernel(batch, dtype, block_size, kv_layout):
    text, resolved = lower_step_for_cuda(batch, block_size, jnp.dtype(dtype), kv_layout=kv_layout)
    assert resolved.dtype == dtype
    assert "__gpu$xla.gpu.triton" in text, "the step must call the Pallas Triton kernel"
    kv_args = kv_cache_args(text, resolved, block_size, kv_layout)
    assert len(kv_args) == 2 * TINY_LLAMA.num_layers, "every layer's K and V pages, in the cache's dtype"
    assert all("tf.aliasing_output" in a or "jax.buffer_donor" in a for a in kv_args), "the KV cache is donated"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_step_decode_lowers_for_cuda_with_the_pallas_kernel(dtype):
    """Several decode steps in one program (multi_step.py): the kernel inside its loop, the KV cache donated."""
    config = EngineConfig(block_size=16, num_blocks=NUM_BLOCKS, num_scheduler_steps=8)
    resolved = resolve(config, TINY_LLAMA, FAKE_GPU, jnp.dtype(dtype))
    runner = model_runner.ModelRunner(random_model(dtype=jnp.dtype(dtype)), TINY_LLAMA, resolved, max_decode_steps=8)
    (graph, *arrays), keywords = runner.decode_args(runner.inputs.decode_run(scheduled("decode", 16), [8, 3, 1]))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arrays)
    text = multi_step.decode_steps.trace(graph, *abstract, **keywords).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" in text
    kv_args = kv_cache_args(text, resolved, 16)
    assert len(kv_args) == 2 * TINY_LLAMA.num_layers
    assert all("tf.aliasing_output" in a or "jax.buffer_donor" in a for a in kv_args), "the KV cache is donated"


def test_float32_weights_over_a_bfloat16_cache_lower_too():
    """Attention runs in the cache's dtype, so q is cast to it rather than refused by the kernel."""
    text, resolved = lower_step_for_cuda("mixed", 16, jnp.float32, dtype="bfloat16")
    assert resolved.dtype == "bfloat16" and "__gpu$xla.gpu.triton" in text
    assert len(kv_cache_args(text, resolved, 16)) == 2 * TINY_LLAMA.num_layers


def test_a_fresh_kv_cache_compiles_the_step_no_other_program_than_a_used_one():
    # Weights committed to their device, as memory-mapped ones are (models/converted.py): the step's
    # outputs, the KV cache among them, are committed then, and a fresh cache must be too, or the
    # first batch's step compiles again when the used cache meets it.
    model = random_model()
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, jax.local_devices()[0]))
    config = EngineConfig(block_size=8, num_blocks=NUM_BLOCKS)
    resolved = resolve(config, TINY_LLAMA, jax.local_devices()[0], jnp.float32)
    runner = model_runner.ModelRunner(model, TINY_LLAMA, resolved)
    runner.execute(scheduled("prefill", 8), [])
    compiles = runner.num_compiles
    runner.execute(scheduled("prefill", 8), [])
    assert runner.num_compiles == compiles
