"""EngineStats: what LLMEngine.stats() reports, its queues, its KV cache and its counters so far."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters (stats())."""

    num_running_requests: int  # admitted: computing their prompt or generating
    num_waiting_requests: int  # waiting for admission (or readmission, after a preemption)
    num_blocks: int  # KV cache blocks a request can hold (the pool's null block left out)
    num_free_blocks: int
    num_cached_blocks: int  # free, but holding a cached prefix a request may match
    block_size: int
    num_preemptions: int
    num_compiles: int
    peak_blocks_in_use: int
    prefix_cache_hit_blocks: int
    prefix_cache_queried_blocks: int
    attention_backend: str
    attention_backend_reason: str
    matmul_backend: str
    matmul_backend_reason: str
    num_batched_tokens: int  # tokens run through the model so far (prompt chunks and decodes)
