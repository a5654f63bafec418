"""What an EngineConfig resolves to once the model, the device and its memory are known: backends, block
size and count, context length, step shapes, scheduling."""

import dataclasses
import logging
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental.pallas import cdiv

from kernels_pallas import BackendChoice, bytes_per_block, choose_backend, cpu_kernel
from kernels_pallas.layout import HEAD_MAJOR, TOKEN_MAJOR
from models.kv_groups import KVGroups, kv_groups
from paged_jax.core.buckets import StepBuckets
from paged_jax.core.config import AUTO_DECODE_STEPS, EngineConfig
from paged_jax.core.window_blocks import max_tokens

logger = logging.getLogger(__name__)

# The KV budget where no device reports its memory (the CPU): what a laptop can spare.
HOST_KV_CACHE_MEMORY_BYTES = 2 << 30
# Backends that run on one platform only; the others run anywhere.
_BACKEND_PLATFORM = {"pallas": "gpu", "cpu": "cpu"}


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """What the engine settled on once it knew the model, the device and its memory."""

    num_blocks: int
    block_size: int
    kv_layout: str  # one of kernels_pallas.LAYOUTS
    max_model_len: int
    max_blocks_per_seq: int
    dtype: str  # of the weights and the model's arithmetic: "float32" or "bfloat16"
    kv_cache_dtype: str  # of the KV pages: "float32" or "bfloat16"
    platform: str  # the JAX platform the engine runs on: "gpu", "cpu", ...
    attention: BackendChoice  # the attention backend that runs (never "auto"), and why
    matmul: BackendChoice  # "cpu" or "xla" (never "auto"), and why
    buckets: StepBuckets  # every shape a step can take
    scheduling: BackendChoice  # "async" or "sync" (engine.py), and why
    num_scheduler_steps: int  # the most decode steps one dispatch runs (multi_step.py)
    kv_groups: KVGroups  # the layers' KV groups (models/kv_groups.py): one unless sliding and full layers mix

    @property
    def attention_backend(self) -> str:
        return self.attention.backend

    @property
    def matmul_backend(self) -> str:
        return self.matmul.backend

    @property
    def async_scheduling(self) -> bool:
        return self.scheduling.backend == "async"

    def log(self) -> None:
        """Say what runs, and why: the attention and matmul backends, the scheduling, the KV groups."""
        # A fallback is slower by a wide margin: said where a user sees it, not only in the stats.
        logger.log(logging.WARNING if self.attention.fallback else logging.INFO, "attention backend %s: %s",
                   self.attention.backend, self.attention.reason)
        logger.info("matmul backend %s: %s", self.matmul.backend, self.matmul.reason)
        logger.info("scheduling %s: %s", self.scheduling.backend, self.scheduling.reason)
        logger.info("up to %d decode step%s a dispatch%s", self.num_scheduler_steps,
                    "s" * (self.num_scheduler_steps > 1), " (multi-step decode)" * (self.num_scheduler_steps > 1))
        if self.kv_groups.num_groups > 1:
            windows = [w for w in self.kv_groups.windows if w is not None]
            logger.info("KV cache in %d layer groups over %d page arrays, %d of them sliding (window %s), each "
                        "holding only its window", self.kv_groups.num_groups, self.kv_groups.num_arrays, len(windows),
                        "/".join(map(str, sorted(set(windows)))))


class Device(Protocol):
    """The part of a jax.Device that resolution reads (tests pass a fake)."""

    platform: str

    def memory_stats(self) -> dict[str, int] | None: ...


def default_device() -> jax.Device:
    """The device new arrays and jitted calls go to: `jax.default_device`'s if set, else this
    process's first."""
    device = jax.config.jax_default_device
    if isinstance(device, str):
        return jax.local_devices(backend=device)[0]
    return device or jax.local_devices()[0]


def default_dtype(platform: str) -> str:
    """What dtype="auto" loads weights in: bfloat16 on a GPU, float32 elsewhere."""
    return "bfloat16" if platform == "gpu" else "float32"


def kv_cache_budget(config: EngineConfig, device: Device) -> int:
    """Bytes the KV cache may take. On a GPU, read once the weights are on it: the allocator's limit
    times gpu_memory_utilization, less what is in use (as vLLM sizes its cache after loading)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    stats = device.memory_stats() if device.platform == "gpu" else None
    if not stats or "bytes_limit" not in stats:
        return HOST_KV_CACHE_MEMORY_BYTES
    limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
    budget = int(config.gpu_memory_utilization * limit) - in_use
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {in_use / 2**30:.2f} GiB in use of "
            f"{config.gpu_memory_utilization} x {limit / 2**30:.2f} GiB; raise gpu_memory_utilization "
            f"or set kv_cache_memory_bytes")
    return budget


def choose_matmul_backend(config: EngineConfig, platform: str, weights_dtype) -> BackendChoice:
    """What runs the model's matmuls, and why; asking for "cpu" where it cannot run is an error."""
    reasons = [why for why, fails in (
        (f"the engine runs on {platform}", platform != "cpu"),
        (f"the weights are {jnp.dtype(weights_dtype).name}, not float32", jnp.dtype(weights_dtype) != jnp.float32),
        ("the weights are split over devices", config.tensor_parallel_size > 1),
    ) if fails]
    # The kernel is built only where it could run (never on a GPU machine).
    if not reasons and not cpu_kernel.available():
        reasons.append(f"the CPU kernel is unavailable: {cpu_kernel.build_error()}")
    if config.quantization is not None and (reasons or config.matmul_backend == "xla"):
        why = "; ".join(reasons) or "matmul_backend 'xla' was asked for"
        raise ValueError(f"quantization {config.quantization!r} runs on the C++ matmul, which cannot run here: {why}")
    if config.matmul_backend == "xla":
        return BackendChoice("xla", "asked for", False)
    if not reasons:
        return BackendChoice("cpu", "asked for" if config.matmul_backend == "cpu" else
                             "the C++ kernel over packed float32 weights on the CPU", False)
    if config.matmul_backend == "cpu":
        raise ValueError(f"matmul_backend 'cpu' cannot run here: {'; '.join(reasons)}")
    return BackendChoice("xla", reasons[0], False)


def kv_block_defaults(config: EngineConfig, attention_backend: str) -> tuple[int, str]:
    """(block_size, kv_layout): the ones asked for, else what the attention backend reads fastest.

    The C++ CPU kernel reads a sequence's blocks whole, each at the rate the hardware prefetcher
    streams within a page: head-major blocks of 64 slots (a KV head's rows contiguous) read K/V about
    1.5x faster than token-major blocks of 16 (scripts/bench_attention_cpu.py; vLLM's CPU build takes
    blocks of 128 for the same reason). Elsewhere, 16-slot token-major blocks: the Pallas kernel's
    tiles and the XLA path's page chunks are sized for them.
    """
    fast_cpu = attention_backend == "cpu"
    block_size = config.block_size or (64 if fast_cpu else 16)
    kv_layout = config.kv_layout if config.kv_layout != "auto" else (HEAD_MAJOR if fast_cpu else TOKEN_MAJOR)
    return block_size, kv_layout


def resolve(config: EngineConfig, model_config, device: Device, weights_dtype) -> ResolvedConfig:
    """Settle the run-time values: context length from the model, dtype (and the KV cache's, unless
    asked) from the weights, attention backend from the platform, block count from the memory budget.

    model_config: a models.ModelConfig, as the engine runs it (KV heads' copies counted, as
        models.sharding lays them out); device: one of the devices the engine runs on;
    weights_dtype: the model's parameter dtype.
    """
    dtype = jnp.dtype(weights_dtype).name if config.dtype == "auto" else config.dtype
    kv_dtype = {"auto": dtype, "bf16": "bfloat16"}.get(config.kv_cache_dtype, config.kv_cache_dtype)
    platform = device.platform
    attention = choose_backend(config.attention_backend, dtype, platform, kv_dtype=kv_dtype)
    backend = attention.backend
    if _BACKEND_PLATFORM.get(backend, platform) != platform:
        raise ValueError(f"attention_backend {backend!r} runs on {_BACKEND_PLATFORM[backend]} only, and this "
                         f"engine runs on {platform}; use 'auto' (or 'pallas_interpret' to run the Pallas "
                         "kernel's body off a GPU, slowly)")
    block_size, kv_layout = kv_block_defaults(config, backend)
    # The context length is the model's, cut to what one sequence can always be given, so that no
    # request waits forever for room: the whole KV cache and, without chunked prefill, one step's
    # tokens (a preempted sequence is computed again in one step). An explicit max_model_len beyond
    # any of these is an error.
    wanted = config.max_model_len or model_config.max_model_len
    num_blocks = config.num_blocks
    groups = kv_groups(model_config, hybrid=not config.disable_hybrid_kv_cache_manager)
    if num_blocks is None:
        # The budget is per device where each has memory of its own (a GPU holds its share of the KV
        # heads); devices on the host (the CPU) share its memory, so their budget is shared too.
        kv_heads = model_config.num_kv_heads
        if platform == "gpu":
            kv_heads //= config.tensor_parallel_size
        per_block = bytes_per_block(groups.num_arrays, block_size, kv_heads, model_config.head_dim, kv_dtype)
        # One more than the budget buys: block 0 is the pool's null block, never handed out.
        num_blocks = min(kv_cache_budget(config, device) // per_block,
                         4 * cdiv(wanted, block_size) * config.max_num_seqs * groups.num_groups) + 1
    if num_blocks - 1 < 1:
        raise ValueError(f"the KV cache holds no block: num_blocks={num_blocks} (block 0 is reserved)")
    pool = f"what the KV cache holds ({num_blocks - 1} blocks of {block_size})"
    limits = {"the model's context length": model_config.max_model_len,
              pool: max_tokens(groups, num_blocks - 1, block_size, config.max_num_batched_tokens)}
    if not config.enable_chunked_prefill:
        limits["max_num_batched_tokens, as chunked prefill is off"] = config.max_num_batched_tokens
    for what, limit in limits.items():
        if wanted > limit and config.max_model_len is not None:
            raise ValueError(f"max_model_len {wanted} exceeds {what}: {limit} tokens")
    max_model_len = min(wanted, *limits.values())
    max_blocks_per_seq = cdiv(max_model_len, block_size)
    return ResolvedConfig(num_blocks=num_blocks, block_size=block_size, kv_layout=kv_layout,
                          max_model_len=max_model_len, max_blocks_per_seq=max_blocks_per_seq,
                          dtype=dtype, kv_cache_dtype=kv_dtype, platform=platform, attention=attention,
                          matmul=choose_matmul_backend(config, platform, weights_dtype),
                          buckets=StepBuckets(config.max_num_batched_tokens, config.max_num_seqs,
                                              max_blocks_per_seq, backend, max_drafts=(
                                                  config.speculative_config.num_speculative_tokens
                                                  if config.speculative_config else 0)),
                          scheduling=choose_scheduling(config, platform),
                          num_scheduler_steps=config.num_scheduler_steps or (
                              1 if platform == "cpu" or config.enable_lora else AUTO_DECODE_STEPS),
                          kv_groups=groups)


def choose_scheduling(config: EngineConfig, platform: str) -> BackendChoice:
    """Whether the engine runs a step ahead (engine.py), and why."""
    if config.async_scheduling != "auto":
        return BackendChoice("async" if config.async_scheduling == "on" else "sync", "asked for", False)
    if platform == "cpu":
        return BackendChoice("sync", "on the CPU the host's work would take a core from the step's own", False)
    return BackendChoice("async", f"on {platform} the host prepares the next step while the device runs", False)
