"""What an LLMEngine is made of, built for one model and config: the resolved settings, the model runner
(the device's side), the block manager and scheduler (the host's), the LoRA slots and the speculator.
The engine runs them (engine.py); this says how they are put together and which combinations are
refused."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.loader import shard_model
from paged_jax.core import cpu_matmul, distributed
from paged_jax.core.adapters import AdapterSlots
from paged_jax.core.block_manager import BlockManager
from paged_jax.core.config import EngineConfig
from paged_jax.core.model_runner import ModelRunner
from paged_jax.core.resolve import ResolvedConfig, default_device, resolve
from paged_jax.core.scheduler import Scheduler
from paged_jax.spec_decode.speculator import Speculator

# A speculating step's draft tokens at most, by platform (SpeculativeConfig.max_draft_tokens_per_step's
# default). On the CPU a step's cost climbs once its rows pass 16 (SmolLM2, 2-core Xeon: 4 decodes beside
# 12, 16, 20 and 24 more tokens cost 1.14, 1.22, 1.40 and 1.54 times 4 alone), and 4 sequences with 5
# drafts each verify 24 rows: 12 drafts a step leaves k = 5 up to 2 sequences and 4 sequences 3 each on average.
DRAFT_BUDGETS = {"cpu": 12}


@dataclasses.dataclass(frozen=True)
class EngineParts:
    model_config: object  # models.ModelConfig as the engine runs it (KV heads' copies counted under TP)
    resolved: ResolvedConfig
    runner: ModelRunner
    blocks: BlockManager
    scheduler: Scheduler
    adapters: AdapterSlots | None  # with enable_lora
    speculator: Speculator | None  # with a speculative_config


def build_parts(model, model_config, config: EngineConfig) -> EngineParts:
    """model: of an architecture in models.registry, on the default device, or already split over the
    engine's mesh. With tensor_parallel_size N > 1 the model is split over the first N devices
    (models/sharding.py)."""
    mesh = distributed.engine_mesh(config.tensor_parallel_size)
    if mesh is not None:
        model = shard_model(model, mesh)
        model_config = dataclasses.replace(model_config, num_kv_heads=model.config.num_kv_heads)
    weights_dtype = jnp.result_type(*jax.tree.leaves(nnx.state(model, nnx.Param)))
    resolved = resolve(config, model_config, default_device(), weights_dtype)
    # In a group of processes each holds a share of one cache: the fewest blocks any has room for.
    num_blocks = distributed.agree(resolved.num_blocks, (config, model_config))
    if num_blocks != resolved.num_blocks:
        resolved = resolve(dataclasses.replace(config, num_blocks=num_blocks), model_config, default_device(),
                           weights_dtype)
    resolved.log()
    if resolved.matmul_backend == "cpu":
        model = model.pack_for_cpu(config.quantization, cpu_matmul.onednn_rows(
            config, model_config, resolved.buckets.token_buckets()))
    adapters = None
    if config.enable_lora:
        if mesh is not None:
            raise ValueError("LoRA adapters run on one device: enable_lora needs tensor_parallel_size 1")
        if resolved.num_scheduler_steps > 1:
            raise ValueError("multi-step decode does not run LoRA adapters yet: enable_lora needs "
                             "num_scheduler_steps 1")
        adapters = AdapterSlots(model_config, config.max_loras, config.max_lora_rank,
                                config.max_cpu_loras or config.max_loras, weights_dtype,
                                packed=resolved.matmul_backend == "cpu")
    if config.speculative_config is not None and resolved.kv_groups.num_groups > 1:
        # A verify step's rejected blocks are given back from block_ids alone (speculator.settle).
        raise ValueError("speculative decoding does not support KV kept in several groups (a model with "
                         "sliding-window layers, Gemma 2 and 3) yet: add disable_hybrid_kv_cache_manager=True")
    runner = ModelRunner(model, model_config, resolved, mesh, max_decode_steps=resolved.num_scheduler_steps,
                         adapters=adapters)
    blocks = BlockManager(resolved.num_blocks, resolved.block_size, config.enable_prefix_caching)
    # The C++ matmuls compute a step's real tokens only (models/llama.py), so its padding costs
    # little, and a prompt chunk cut to fill its bucket would only add a step.
    padding_costs = resolved.matmul_backend != "cpu"
    scheduler = Scheduler(config, blocks, swapper=runner,
                          token_buckets=tuple(resolved.buckets.token_buckets()) if padding_costs else (),
                          max_model_len=resolved.max_model_len, adapters=adapters, kv_groups=resolved.kv_groups)
    speculator = None
    if config.speculative_config is not None:
        spec = config.speculative_config
        budget = spec.max_draft_tokens_per_step
        speculator = Speculator(spec, resolved.max_model_len, resolved.buckets.num_head_rows, resolved.block_size,
                                DRAFT_BUDGETS.get(resolved.platform) if budget is None else budget)
        runner.speculative = True
    return EngineParts(model_config, resolved, runner, blocks, scheduler, adapters, speculator)
