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
    num_compiles: int  # programs the runner compiled (core/compiles.py counts the whole process's)
    device_seconds: float  # dispatching steps and waiting for their samples, so far
    peak_blocks_in_use: int
    prefix_cache_hit_blocks: int
    prefix_cache_queried_blocks: int
    attention_backend: str
    attention_backend_reason: str
    matmul_backend: str
    matmul_backend_reason: str
    num_batched_tokens: int  # tokens run through the model so far (prompt chunks and decodes)
    # Speculative decoding (spec_decode/speculator.SpecStats), so far; zeros without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # The LoRA adapters (names, sorted) of the running sequences, and of those waiting; empty without LoRA.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


def track_peak(engine, scheduled) -> None:
    """Peak blocks held by sequences, and the share of their slots holding real tokens, with a step's
    scheduled sequences (scheduler.ScheduledSeq) counted."""
    blocks = engine.blocks
    in_use = blocks.num_blocks - 1 - blocks.num_free - blocks.num_evictable
    if in_use > engine.peak_blocks_in_use:
        engine.peak_blocks_in_use = in_use
        held = sum(s.num_new_tokens for s in scheduled) + sum(s.num_computed_tokens for s in engine.scheduler.running)
        engine.peak_slot_fill = held / (in_use * engine.resolved.block_size)


def snapshot(engine) -> EngineStats:
    """engine: an LLMEngine; its stats() now."""
    cache, blocks, scheduler = engine.blocks.cache, engine.blocks, engine.scheduler
    waiting = len({seq.request_id for seq in scheduler.waiting} | engine.gate.request_ids)
    resolved = engine.resolved
    return EngineStats(
        num_running_requests=engine.num_unfinished_requests - waiting, num_waiting_requests=waiting,
        num_blocks=blocks.num_blocks - 1, num_free_blocks=blocks.num_free, num_cached_blocks=blocks.num_evictable,
        block_size=resolved.block_size,
        num_preemptions=scheduler.num_preemptions,
        num_compiles=engine.runner.num_compiles,
        device_seconds=engine.runner.device_seconds,
        peak_blocks_in_use=engine.peak_blocks_in_use,
        prefix_cache_hit_blocks=cache.hit_blocks if cache is not None else 0,
        prefix_cache_queried_blocks=cache.queried_blocks if cache is not None else 0,
        attention_backend=resolved.attention.backend,
        attention_backend_reason=resolved.attention.reason,
        matmul_backend=resolved.matmul.backend,
        matmul_backend_reason=resolved.matmul.reason,
        num_batched_tokens=engine.num_batched_tokens,
        running_lora_adapters=_names(scheduler.running), waiting_lora_adapters=_names(waiting_seqs(engine)),
        **_spec(engine.speculator))


def waiting_seqs(engine) -> list:
    """The engine's sequences waiting for admission: queued, or waiting for their grammar."""
    return [*engine.scheduler.waiting, *engine.gate.seqs]


def _names(seqs) -> tuple[str, ...]:
    return tuple(sorted({seq.lora.lora_name for seq in seqs if seq.lora is not None}))


def _spec(speculator) -> dict:
    if speculator is None:
        return {}
    s = speculator.stats
    return dict(spec_num_drafts=s.num_drafts, spec_num_draft_tokens=s.num_draft_tokens,
                spec_num_accepted_tokens=s.num_accepted_tokens, spec_accepted_per_position=tuple(s.accepted_per_position))
