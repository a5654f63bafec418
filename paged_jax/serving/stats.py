"""What the serving loop saw, handed to stat loggers once per loop iteration (vLLM's split):
`SchedulerStats`, the engine's state after the iteration, and `IterationStats`, what happened in it.

The engine's own counters (preemptions, prefix-cache lookups, compiles) are cumulative here, as the
engine keeps them; a logger that exports increments takes differences.
"""

import dataclasses


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
