"""What the serving loop saw, handed to stat loggers once per loop iteration (vLLM's split):
`SchedulerStats`, the engine's state after the iteration, and `IterationStats`, what happened in it;
and how the loop counts them, from the engine's stats() and each request's outputs (RequestTally).

The engine's own counters (preemptions, prefix-cache lookups, compiles) are cumulative here, as the
engine keeps them; a logger that exports increments takes differences.
"""

import dataclasses

from paged_jax.core import compiles
from paged_jax.core.engine_stats import EngineStats
from paged_jax.core.outputs import RequestOutput


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int  # requests the scheduler holds that are not waiting
    num_waiting: int  # requests waiting for admission (new, or preempted), accepted but not yet added too
    num_blocks: int  # usable KV blocks (the pool's null block aside)
    num_free_blocks: int
    num_cached_blocks: int  # held by the prefix cache alone: reusable, evicted when the pool runs short
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache (whole blocks)
    prefix_cache_hits: int  # of those, tokens found
    num_compiles: int  # every XLA program compiled or loaded in the process (core/compiles.py)
    num_batched_tokens: int  # tokens run through the model
    # Speculative decoding, cumulative (EngineStats' spec_* fields).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # The LoRA adapters (names) that running requests use, and waiting ones (EngineStats').
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks - self.num_cached_blocks

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV blocks that running requests hold (cached-only blocks count as free)."""
        return self.num_used_blocks / self.num_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort", "timeout" or "error"
    e2e_latency: float  # seconds from arrival to the end
    num_prompt_tokens: int
    num_generation_tokens: int  # all samples together
    max_tokens: int
    n: int


@dataclasses.dataclass(slots=True)
class IterationStats:
    """Filled in during one loop iteration; step_time is None when no step ran (only adds, aborts)."""

    step_time: float | None = None
    # Of the iteration's time (its step, and handing the outputs over): waiting for the device (from
    # the step's first call until its samples were on the host), and the rest, the host's own work.
    device_time: float | None = None
    host_time: float | None = None
    num_batched_tokens: int = 0
    num_prompt_tokens: int = 0  # prompts whose first token came in this iteration
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)
    queue_times: list[float] = dataclasses.field(default_factory=list)  # requests first scheduled
    finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)


class StatLogger:
    """What the loop calls after every iteration, on its own thread: keep it quick."""

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        raise NotImplementedError


def scheduler_stats(stats: EngineStats, num_queued: int) -> SchedulerStats:
    """SchedulerStats from the engine's; num_queued: the requests waiting, those the engine has not
    been handed yet included."""
    return SchedulerStats(
        num_running=stats.num_running_requests, num_waiting=num_queued, num_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks, num_cached_blocks=stats.num_cached_blocks,
        num_preemptions=stats.num_preemptions,
        prefix_cache_queries=stats.prefix_cache_queried_blocks * stats.block_size,
        prefix_cache_hits=stats.prefix_cache_hit_blocks * stats.block_size,
        num_compiles=compiles.count(), num_batched_tokens=stats.num_batched_tokens,
        spec_decode_num_drafts=stats.spec_num_drafts, spec_decode_num_draft_tokens=stats.spec_num_draft_tokens,
        spec_decode_num_accepted_tokens=stats.spec_num_accepted_tokens,
        spec_decode_accepted_per_position=stats.spec_accepted_per_position,
        running_lora_adapters=stats.running_lora_adapters, waiting_lora_adapters=stats.waiting_lora_adapters)


@dataclasses.dataclass(eq=False)
class RequestTally:
    """What the loop has counted of one request the engine holds, from its DELTA outputs."""

    max_tokens: int
    n: int
    num_prompt_tokens: int  # 0 for a text prompt until its first output shows the token ids
    num_generation_tokens: int = 0
    scheduled: bool = False
    last_token_time: float | None = None

    def observe(self, out: RequestOutput, arrival_time: float, now: float, it: IterationStats) -> float | None:
        """Count a delta output into `it`; the request's time in the queue, the first time an output
        shows it was scheduled."""
        queued = None
        if not self.scheduled and out.metrics.first_scheduled_time is not None:
            self.scheduled = True
            queued = out.metrics.first_scheduled_time - arrival_time
            it.queue_times.append(queued)
        generated = sum(len(c.token_ids) for c in out.outputs)
        if generated:
            if self.last_token_time is None:
                self.num_prompt_tokens = len(out.prompt_token_ids)
                it.time_to_first_tokens.append(now - arrival_time)
                it.num_prompt_tokens += self.num_prompt_tokens
            else:
                it.inter_token_latencies.append(now - self.last_token_time)
            it.num_generation_tokens += generated
            self.num_generation_tokens += generated
            self.last_token_time = now
        return queued

    def finished(self, reason: str, arrival_time: float, now: float) -> FinishedRequestStats:
        return FinishedRequestStats(reason, now - arrival_time, self.num_prompt_tokens, self.num_generation_tokens,
                                    self.max_tokens, self.n)
