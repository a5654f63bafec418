"""AsyncLLMEngine (vLLM's name AsyncLLM too): the engine behind an asyncio front end.

    engine = AsyncLLMEngine.from_pretrained("smollm2-135m")
    async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=16), "r1"):
        print(out.outputs[0].text)

A thread of its own runs the engine (engine_loop.py); callers hand it commands and read their
requests' outputs from streams (request_stream.py), so an event loop stays free while a step runs (a
server's /health and /metrics answer). Each output is what the request's output_kind asks for.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from models import DEFAULT_MODEL
from paged_jax.core.engine import LLMEngine
from paged_jax.core.lora_request import LoRARequest
from paged_jax.core.outputs import RequestOutput
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.validation import EngineLimits
from paged_jax.serving.engine_loop import EngineLoop
from paged_jax.serving.loop_commands import Add, Call, EngineDeadError, EngineStepError, QueueFullError
from paged_jax.serving.request_stream import RequestStream
from paged_jax.serving.stats import SchedulerStats, StatLogger

__all__ = ["AsyncLLM", "AsyncLLMEngine", "EngineDeadError", "EngineStepError", "QueueFullError", "RequestStream",
           "StatLogger"]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, max_num_queued_reqs: int | None = None,
                 max_queue_time: float | None = None, stat_loggers: Sequence[StatLogger] = (),
                 warm_up: bool = True, probe_prefill: bool = False):
        """max_num_queued_reqs: how many requests may wait for admission; add_request raises
        QueueFullError beyond it (None: no limit). A request counts as waiting once the requests ahead
        of it fill max_num_seqs, so a burst into an idle engine is not refused. max_queue_time: seconds
        a request may wait for its first admission; then it ends with finish_reason "queue_timeout".
        warm_up: the loop first makes every program a step can run (core/warmup.py) and is ready after;
        requests that come sooner wait for it. probe_prefill: after the warm-up, time one full prefill step
        (prefill_clock.py) and hand it to the stat loggers as the first iteration, before ready."""
        if max_num_queued_reqs is not None and max_num_queued_reqs < 0:
            raise ValueError(f"max_num_queued_reqs must be >= 0, got {max_num_queued_reqs}")
        if max_queue_time is not None and max_queue_time <= 0:
            raise ValueError(f"max_queue_time must be positive, got {max_queue_time}")
        self.engine = engine
        self.limits: EngineLimits = engine.limits
        self.tokenizer = engine.tokenizer
        # Structured outputs' compiler (thread-safe): a front end compiles a request's constraint before
        # adding it, to refuse one that does not compile; the engine then finds it cached.
        self.grammars = engine.gate.compiler
        self._loop = EngineLoop(engine, max_num_queued_reqs, max_queue_time, stat_loggers, warm_up, probe_prefill)

    @classmethod
    def from_pretrained(cls, model: str = DEFAULT_MODEL, *, max_num_queued_reqs: int | None = None,
                        stat_loggers: Sequence[StatLogger] = (), **engine_options) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_pretrained(model, **engine_options), max_num_queued_reqs=max_num_queued_reqs,
                   stat_loggers=stat_loggers)

    @property
    def is_running(self) -> bool:
        return self._loop.thread.is_alive() and not self._loop.stopping

    @property
    def is_ready(self) -> bool:
        """Running, and warmed up: no request will meet a compile."""
        return self._loop.warmed.is_set() and self.is_running

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engine's state after the loop's latest iteration."""
        return self._loop.scheduler_stats

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, *, timeout: float | None = None,
                          priority: int = 0, lora_request: LoRARequest | None = None) -> RequestStream:
        """Hand a request to the engine; returns its stream once the engine has accepted it.

        Raises what LLMEngine.add_request raises for a bad request (RequestError), QueueFullError
        when the waiting queue is full, EngineDeadError when the loop has stopped. timeout: seconds from
        now until the stream ends the request with finish_reason "timeout". priority: as
        LLMEngine.add_request takes it (scheduling_policy "priority": lower runs first). lora_request:
        the LoRA adapter it runs with (None: the base model).
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        request_id = uuid.uuid4().hex if request_id is None else request_id
        stream = RequestStream(self, request_id, params, () if isinstance(prompt, str) else prompt, loop,
                               None if timeout is None else loop.time() + timeout)
        self._loop.add(Add(request_id, prompt, params, stream, priority, lora_request))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self._abort(request_id, "abort")
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, timeout: float | None = None,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving the loop early (or aclose()) aborts it."""
        stream = await self.add_request(prompt, params, request_id, timeout=timeout, priority=priority,
                                        lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def queue_position(self, count: int = 1) -> int:
        """Where the last of `count` requests added now would stand in the waiting queue (1: first in
        line; 0: admitted at once, as far as max_num_seqs goes)."""
        return self._loop.queue_position(count)

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine), run on the loop's thread between two steps (the engine is not thread-safe), and
        what it returns or raises. The next step waits for it: keep it quick."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        future = asyncio.get_running_loop().create_future()
        self._loop.call(Call(fn, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks before the next step; its stream ends with finish_reason
        "abort". Unknown ids are ignored."""
        self._abort(request_id, "abort")

    def _abort(self, request_id: str, reason: str) -> None:
        self._loop.abort(request_id, reason)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop: requests still running end with finish_reason "abort"."""
        self._loop.stop(timeout)


AsyncLLM = AsyncLLMEngine
