"""Engine configuration: what the user asks, in vLLM's option names where one exists (resolve.py
settles what it means on this model and device)."""

import dataclasses

from kernels_pallas import BACKENDS, LAYOUTS
from paged_jax.core.policy import POLICIES
from paged_jax.spec_decode.config import SpeculativeConfig

# Decode steps a dispatch on an accelerator, unless asked (multi_step.py): where the host's work per step
# rivals the device's, 8 steps leave it an eighth (docs/performance.md#multi-step-decode). On the CPU a
# real model's step costs the host's many times over, and more steps only delay arrivals.
AUTO_DECODE_STEPS = 8

DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = (None, "int8")
# vLLM's names for the KV cache's dtype ("auto": the model's); "bf16" is "bfloat16".
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "bf16")
MATMUL_BACKENDS = ("auto", "cpu", "xla")


def _option(default, help: str, choices: tuple | None = None):
    """An EngineConfig field with its command-line help, and the values it may take if they are few:
    the server makes a flag of every field from these (serving/cli.py), and the config checks choices."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the user asks of the engine. Values found at run time (how many blocks fit, the model's
    context length, what "auto" means on this device) live in `ResolvedConfig`, never written back here."""

    # None: what the attention backend reads fastest (kv_block_defaults).
    block_size: int | None = _option(None, "tokens per KV-cache block (default: 64 for the C++ CPU kernel, else 16)")
    # KV capacity: an explicit block count wins over an explicit memory budget, which wins over
    # gpu_memory_utilization (a GPU) or HOST_KV_CACHE_MEMORY_BYTES (elsewhere).
    num_blocks: int | None = _option(None, "KV-cache blocks (overrides --kv-cache-memory-bytes)")
    kv_cache_memory_bytes: int | None = _option(None, "memory for the KV cache")
    # Of the memory JAX's GPU allocator may use (its bytes_limit: 75% of the GPU unless
    # XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise); the rest is left to the step's activations.
    gpu_memory_utilization: float = _option(0.9, "share of GPU memory for weights and KV cache")
    max_num_seqs: int = _option(64, "most sequences in one step")
    max_num_batched_tokens: int = _option(1024, "most tokens in one step")
    # While sequences decode, a step's tokens in all when it carries prompt tokens beside them (but at
    # least 3 prompt tokens per decode; 0: no cap beyond max_num_batched_tokens), so that a long prompt
    # does not stall every decode for a whole long step (scheduler.py; the cap lifts while more than
    # step_budget.BACKLOG requests wait). vLLM's name: vLLM caps each request's chunk; this caps the
    # step, and only while something decodes. The default takes W1's prompts (up to 512 tokens) whole:
    # since the C++ matmuls skip a step's padding, one step of a whole prompt gave first tokens sooner
    # than 256 (W1 served at 1, 2, 4 requests/s, AMD EPYC: TTFT median 203 / 223 / 268 ms against 207 /
    # 235 / 299), while ITL p99 rose from 141 / 169 / 171 to 163 / 241 / 298 ms, still below vLLM's.
    long_prefill_token_threshold: int = _option(
        512, "a step's tokens while sequences decode, prompts filling the rest (0: no cap)")
    # A prompt that cannot finish in this step waits while that many are part-way; 1 finishes prompts
    # one at a time, first come first, which gives the earliest first tokens.
    max_num_partial_prefills: int = _option(1, "most prompts part-way through their prefill at once")
    max_model_len: int | None = _option(None, "context length (default: the model's)")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _option(True, "split long prompts over steps, beside decodes")
    preemption_mode: str = _option("recompute", "how a sequence gives way when the KV cache runs short",
                                   ("recompute", "swap"))
    # policy.py; "priority" lets requests carry a priority.
    scheduling_policy: str = _option("fcfs", "who is admitted first and preempted last (priority: lower value first)",
                                     POLICIES)
    # Of the KV cache, and of the weights `LLMEngine.from_pretrained` loads. "auto": bfloat16 on a GPU,
    # float32 (the fast dtype there) on the CPU; for a model handed to the engine, its weights' dtype.
    dtype: str = _option("auto", "parameter and KV-cache dtype", DTYPES)
    # The KV cache's alone: "bfloat16" under float32 weights halves the bytes decode reads and holds
    # twice the tokens in the same budget; on the CPU the C++ kernel widens its pages to float32 as it
    # reads them, so only K/V's rounding on write costs accuracy (scripts/eval_precision.py).
    kv_cache_dtype: str = _option(
        "auto", "KV-cache dtype; auto: --dtype's. bfloat16 under float32 weights halves the K/V bytes", KV_CACHE_DTYPES)
    attention_backend: str = _option("auto", "paged-attention implementation", BACKENDS)
    # "cpu" packs the weights once for the C++ kernel (kernels_pallas/cpu/linear.cc); "auto" takes it
    # for float32 weights on one CPU device.
    matmul_backend: str = _option(
        "auto", "the model's matmuls: cpu packs the weights for the C++ kernel, xla leaves them to XLA",
        MATMUL_BACKENDS)
    # vLLM's name. "int8": the layers' weights in int8 with per-column scales, activations quantized
    # per token as the step runs, through the C++ matmul (kernels_pallas/cpu/linear_int8.cc); float32
    # weights on one CPU device only. None: the weights as loaded.
    quantization: str | None = _option(
        None, "int8: the layers' weights in int8, activations quantized per token (the C++ matmul, float32 "
        "on one CPU)", QUANTIZATIONS)
    # kernels_pallas/layout.py; "auto": what the attention backend reads fastest (kv_block_defaults).
    kv_layout: str = _option(
        "auto", "KV page layout: token-major [block, slot, head, dim] or head-major [block, head, slot, dim]; "
        "auto: head-major for the C++ CPU kernel, else token-major", ("auto", *LAYOUTS))
    # models/sharding.py; on a GPU the KV budget is per device.
    tensor_parallel_size: int = _option(1, "devices to split the model's heads and MLP over (tensor parallelism)")
    seed: int = _option(0, "engine seed, for requests without their own")
    # vLLM's name (there a bool; True and False are taken for "on" and "off"). engine.py: the host
    # schedules and builds step N+1 while the device runs step N. "auto": on where the model runs on
    # an accelerator; on the CPU the host's thread would take a core from the step's own compute.
    async_scheduling: str = _option(
        "auto", "schedule step N+1 while step N runs (auto: on a GPU, off on the CPU)", ("auto", "on", "off"))
    # vLLM's (V0) name. multi_step.py: while every running sequence decodes and none needs the host
    # between tokens, one dispatch runs up to this many decode steps.
    num_scheduler_steps: int | None = _option(
        None, f"decode steps per dispatch while every sequence decodes (default: {AUTO_DECODE_STEPS} on a GPU, 1 on the CPU)")
    # vLLM's name. A model that mixes sliding-window and full attention (Gemma 2 and 3) keeps its
    # layers' KV in groups with a page table each, and a sliding group gives back the blocks its window
    # has passed (models/kv_groups.py, window_blocks.py); disabled, every layer keeps every block.
    disable_hybrid_kv_cache_manager: bool = _option(
        False, "keep every block in every layer, even where sliding-window layers no longer read it")
    # spec_decode/; vLLM's name and keys. A dict or its JSON is taken too.
    speculative_config: SpeculativeConfig | None = _option(
        None, 'speculative decoding, JSON of vLLM\'s keys: {"method": "ngram" or "suffix", "num_speculative_tokens": '
        'k, "prompt_lookup_min": a, "prompt_lookup_max": b, "disable_by_batch_size": n}')

    # LoRA adapters (vLLM's names): max_loras device slots of rank max_lora_rank (models/lora.py), the host
    # copies of max_cpu_loras adapters (None: max_loras). Float32 or bfloat16 weights on one device.
    enable_lora: bool = _option(False, "serve LoRA adapters over the base model, each request naming its own")
    max_loras: int = _option(1, "LoRA adapters on the device at once (each step may mix them all)")
    max_lora_rank: int = _option(16, "the largest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _option(None, "LoRA adapters kept in host memory (default: max_loras)")

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if isinstance(self.async_scheduling, bool):
            object.__setattr__(self, "async_scheduling", "on" if self.async_scheduling else "off")
        for name in ("block_size", "num_blocks", "kv_cache_memory_bytes", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "tensor_parallel_size", "max_num_partial_prefills",
                     "num_scheduler_steps", "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for field in dataclasses.fields(self):
            choices, value = field.metadata.get("choices"), getattr(self, field.name)
            if choices is not None and value not in choices:
                raise ValueError(f"{field.name} must be one of {choices}, got {value!r}")
