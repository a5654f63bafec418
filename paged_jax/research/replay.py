"""Replay a workload through the real Scheduler and BlockManager without a model, on a simulated clock.

Each step the scheduler decides as it does in the engine; the model is replaced by a step-cost model
(seconds = a + b * tokens computed + c * context tokens attended) and by a made-up next token, so a
configuration of the scheduler (policy, token and sequence budgets, chunked prefill, preemption mode,
pool size) is measured in a fraction of a second of host time (0.1 to 0.5 s for 100 requests; the
block manager's bookkeeping alone, without its pool of record). Swapped-out KV costs nothing here: the cost model knows no
transfer time.
"""

import dataclasses
import json
import pathlib
from collections.abc import Callable

import numpy as np

from paged_jax.core.block_manager import BlockManager
from paged_jax.core.config import EngineConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.sequence import Sequence
from paged_jax.core.snapshot import scheduler_snapshot

# Made-up tokens come from above any real prompt's ids, so they never extend a prompt's cached prefix.
_TOKEN_BASE = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of one engine step: a + b * tokens computed + c * context tokens attended."""

    a: float
    b: float
    c: float

    def seconds(self, num_tokens: int, num_context: int) -> float:
        return self.a + self.b * num_tokens + self.c * num_context

    @classmethod
    def load(cls, path: pathlib.Path) -> "StepCost":
        fitted = json.loads(pathlib.Path(path).read_text())
        return cls(fitted["a"], fitted["b"], fitted["c"])


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float = 0.0  # seconds from the start of the replay
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class Replay:
    """What happened, per request (in the order given) and per step."""

    first_token_time: np.ndarray  # float64 [requests]; seconds from the start
    finish_time: np.ndarray  # float64 [requests]
    arrival_time: np.ndarray  # float64 [requests]
    num_output_tokens: np.ndarray  # int64 [requests]
    step_time: np.ndarray  # float64 [steps]; the clock when each step ended
    step_tokens: np.ndarray  # int64 [steps]; tokens computed in each step
    queue_depth: np.ndarray  # int64 [steps]; sequences waiting after each step's decision
    num_running: np.ndarray  # int64 [steps]; sequences running after each step's decision
    slots_in_use: np.ndarray  # int64 [steps]; token slots of the blocks running sequences hold
    tokens_held: np.ndarray  # int64 [steps]; tokens whose KV those blocks hold after the step
    num_preemptions: int
    prefix_hit_tokens: int
    peak_blocks_in_use: int  # blocks held by running sequences, at the fullest step

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> np.ndarray:
        return self.finish_time - self.arrival_time

    @property
    def tpot(self) -> np.ndarray:
        """Seconds per output token after the first (requests with one output token are NaN)."""
        rest = self.num_output_tokens - 1
        return np.where(rest > 0, (self.finish_time - self.first_token_time) / np.maximum(rest, 1), np.nan)

    @property
    def throughput(self) -> float:
        """Output tokens per second, over the whole replay."""
        return float(self.num_output_tokens.sum() / self.finish_time.max())


class _NoKV:
    """A swapper for a run without a KV cache: swapping moves nothing."""

    def swap_out(self, block_ids: list[int]) -> object:
        return block_ids

    def swap_in(self, saved: object, block_ids: list[int]) -> None:
        pass


def replay(config: EngineConfig, num_blocks: int, requests: list[Request], cost: StepCost,
           max_steps: int = 1_000_000, *, functional_pool: bool = False,
           observe: Callable[[float, dict], None] | None = None) -> Replay:
    """Run requests to completion; num_blocks counts the null block, as the engine's pool does.

    Every request generates exactly max_tokens tokens (EOS ignored), as the benchmarks here do. The
    pool is checked to be all free (prefix cache dropped) at the end: blocks never leak. With
    functional_pool, each step is also replayed on the block manager's pool of record, as in the
    engine (block_manager.py), which checks the host's bookkeeping step by step. observe(clock, snapshot), when given, sees
    the pool and queues after each step (core/snapshot.py's scheduler_snapshot), the step's row in
    the result recorded just before.
    """
    if config.block_size is None:
        raise ValueError("replay models blocks of a given size: set config.block_size")
    blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                          functional_pool=functional_pool)
    scheduler = Scheduler(config, blocks, swapper=_NoKV())
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
    seqs = [Sequence(seq_id=i, request_id=str(i), token_ids=list(r.prompt_token_ids),
                     num_prompt_tokens=len(r.prompt_token_ids), params=SamplingParams(max_tokens=r.max_tokens),
                     seed=0, arrival_time=r.arrival_time, priority=r.priority) for i, r in enumerate(requests)]
    clock, arrived = 0.0, 0
    steps = []  # (clock, tokens, waiting, running, slots, held)
    peak = 0
    while arrived < len(order) or scheduler.has_unfinished():
        if len(steps) >= max_steps:
            raise RuntimeError(f"replay unfinished after {max_steps} steps")
        if not scheduler.has_unfinished():
            clock = max(clock, requests[order[arrived]].arrival_time)
        while arrived < len(order) and requests[order[arrived]].arrival_time <= clock:
            scheduler.add(seqs[order[arrived]])
            arrived += 1
        out = scheduler.schedule()
        context = sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        clock += cost.seconds(out.num_tokens, context) if out.scheduled else 0.0
        peak = max(peak, sum(len(s.block_ids) for s in scheduler.running))
        for s in out.scheduled:
            seq, samples = s.seq, s.samples  # read before the count moves on
            seq.num_computed_tokens += s.num_new_tokens
            if not samples:
                continue
            seq.token_ids.append(_TOKEN_BASE + seq.seq_id * 65_536 + seq.num_output_tokens)
            if seq.first_token_time is None:
                seq.first_token_time = clock
            if seq.num_output_tokens >= seq.params.max_tokens:
                seq.finish_time = clock
                scheduler.finish(seq)
        # The blocks of a running sequence cover exactly its computed tokens once the step is done.
        slots = sum(len(s.block_ids) for s in scheduler.running) * config.block_size
        held = sum(s.num_computed_tokens for s in scheduler.running)
        blocks.commit()
        steps.append((clock, out.num_tokens, len(scheduler.waiting), len(scheduler.running), slots, held))
        if observe is not None:
            observe(clock, scheduler_snapshot(scheduler, blocks))
    blocks.reset_prefix_cache()
    blocks.commit()
    blocks.check()
    if blocks.num_free != num_blocks - 1 or (blocks.pool is not None and int(blocks.pool.num_free) != num_blocks - 1):
        raise RuntimeError(f"blocks leaked: {num_blocks - 1 - blocks.num_free} still held after the replay")
    columns = np.array(steps).T if steps else np.zeros((6, 0))
    return Replay(
        first_token_time=np.array([s.first_token_time for s in seqs], dtype=np.float64),
        finish_time=np.array([s.finish_time for s in seqs], dtype=np.float64),
        arrival_time=np.array([r.arrival_time for r in requests], dtype=np.float64),
        num_output_tokens=np.array([s.num_output_tokens for s in seqs]),
        step_time=columns[0], step_tokens=columns[1].astype(np.int64), queue_depth=columns[2].astype(np.int64),
        num_running=columns[3].astype(np.int64), slots_in_use=columns[4].astype(np.int64),
        tokens_held=columns[5].astype(np.int64), num_preemptions=scheduler.num_preemptions,
        prefix_hit_tokens=sum(s.num_prefix_hit_tokens for s in seqs), peak_blocks_in_use=peak)
