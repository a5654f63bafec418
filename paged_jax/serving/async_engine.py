"""AsyncLLMEngine (vLLM's name AsyncLLM too): the engine behind an asyncio front end.

    engine = AsyncLLMEngine.from_pretrained("smollm2-135m")
    async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=16), "r1"):
        print(out.outputs[0].text)

One thread owns the LLMEngine, which is not thread-safe, and loops: run the commands in its inbox (add,
abort, stop), run one step, hand each request's newest output to the event loop its caller waits on.
Callers never touch the engine, so an event loop stays free while a step runs (a server's /health and
/metrics answer), and the thread does nothing besides the step but bookkeeping.

Outputs are cumulative (the full text so far), so a reader that falls behind skips to the newest one and
nothing queues up behind a slow client.
"""

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from paged_jax.core.engine import LLMEngine
from paged_jax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.serving.stats import FinishedRequestStats, IterationStats, SchedulerStats

log = logging.getLogger(__name__)

# How long the loop waits for commands when the engine holds requests but could schedule none of them.
_IDLE_WAIT_S = 0.01


class QueueFullError(RuntimeError):
    """The engine already holds as many waiting requests as it was allowed: try again later."""

    def __init__(self, num_waiting: int, retry_after: float):
        super().__init__(f"{num_waiting} requests are already waiting, the most this server queues; retry later")
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or died): no request can run."""


class EngineStepError(RuntimeError):
    """The engine step that ran this request raised; the request ended with it."""


class RequestStream:
    """One request's outputs, an async iterator of RequestOutput that ends after the finished one.

    At its deadline the stream aborts the request and ends with an output whose unfinished samples say
    finish_reason "timeout". close() aborts the request if it has not finished.
    """

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, params: SamplingParams,
                 prompt_token_ids: Sequence[int], loop: asyncio.AbstractEventLoop, deadline: float | None):
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()  # set once the engine has checked the request
        self._engine = engine
        self._params = params
        self._prompt_token_ids = list(prompt_token_ids)
        self._arrival = time.monotonic()
        self._deadline = deadline  # in loop.time(); None waits for ever
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._last: RequestOutput | None = None
        self._done = False

    def _put(self, item: RequestOutput | BaseException | str) -> None:
        """On the event loop: the engine's newest output, an error, or the reason it ended the request."""
        if self._done:
            return
        if isinstance(item, str):
            item = self._ended(item)
        if not isinstance(self._pending, BaseException):
            self._pending = item
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self._deadline):
                await self._ready.wait()
            item = self._pending
        except TimeoutError:
            self._engine._abort(self.request_id, "timeout")
            item = self._ended("timeout")
        self._pending = None
        self._ready.clear()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._last = item
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine._abort(self.request_id, "abort")

    def _ended(self, reason: str) -> RequestOutput:
        """The newest output, finished: every sample still running ends with `reason`."""
        newest = self._pending if isinstance(self._pending, RequestOutput) else self._last
        have = {c.index: c for c in newest.outputs} if newest else {}
        logprobs = [] if self._params.logprobs is not None else None
        completions = [
            dataclasses.replace(have[i], finish_reason=have[i].finish_reason or reason) if i in have
            else CompletionOutput(i, "", [], None, logprobs, reason)
            for i in range(max(self._params.n, len(have)))
        ]
        now = time.monotonic()
        if newest is None:
            return RequestOutput(self.request_id, None, self._prompt_token_ids, completions, True,
                                 RequestMetrics(self._arrival, None, now, 0, 0, 0))
        return dataclasses.replace(newest, outputs=completions, finished=True,
                                   metrics=dataclasses.replace(newest.metrics, finish_time=now))


@dataclasses.dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    priority: int


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str
    reason: str  # "abort" or "timeout", for the metrics


@dataclasses.dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future


_STOP = object()


@dataclasses.dataclass(eq=False)
class _Live:
    """The loop's bookkeeping of one request the engine holds."""

    stream: RequestStream
    arrival: float
    params: SamplingParams
    num_prompt_tokens: int
    num_generation_tokens: int = 0
    scheduled: bool = False
    last_token_time: float | None = None

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        return FinishedRequestStats(reason, now - self.arrival, self.num_prompt_tokens, self.num_generation_tokens,
                                    self.params.max_tokens, self.params.n)


class StatLogger:
    """What the loop calls after every iteration, on its own thread: keep it quick."""

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        raise NotImplementedError


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, max_num_queued_reqs: int | None = None,
                 max_queue_time: float | None = None, stat_loggers: Sequence[StatLogger] = ()):
        """max_num_queued_reqs: how many requests may wait for admission; add_request raises
        QueueFullError beyond it (None: no limit). A request counts as waiting once the requests ahead
        of it fill max_num_seqs, so a burst into an idle engine is not refused. max_queue_time: seconds
        a request may wait for its first admission; then it ends with finish_reason "queue_timeout"."""
        if max_num_queued_reqs is not None and max_num_queued_reqs < 0:
            raise ValueError(f"max_num_queued_reqs must be >= 0, got {max_num_queued_reqs}")
        if max_queue_time is not None and max_queue_time <= 0:
            raise ValueError(f"max_queue_time must be positive, got {max_queue_time}")
        self.engine = engine
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_queue_time = max_queue_time
        self._stat_loggers = list(stat_loggers)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # The queue cap is checked on the caller's side and kept on the loop's: both under the lock.
        self._lock = threading.Lock()
        self._num_running = 0  # requests the engine holds that were admitted
        self._num_waiting = 0  # requests the engine holds that wait for admission
        self._num_inbox_adds = 0  # requests accepted into the inbox, not yet handed to the engine
        self._mean_queue_time = 1.0  # recent time to admission (s), what a rejected caller is told to wait
        self._live: dict[str, _Live] = {}  # loop thread only
        self._iteration = IterationStats()
        self._stopping = False
        self.scheduler_stats = self._scheduler_stats()
        self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m", *, max_num_queued_reqs: int | None = None,
                        stat_loggers: Sequence[StatLogger] = (), **engine_options) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_pretrained(model, **engine_options), max_num_queued_reqs=max_num_queued_reqs,
                   stat_loggers=stat_loggers)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def queue_position(self, count: int = 1) -> int:
        """Where the last of `count` requests added now would stand in the waiting queue (1: first in
        line; 0: admitted at once, as far as max_num_seqs goes)."""
        with self._lock:
            return self._queued(count)

    def _queued(self, count: int = 0) -> int:
        # Under the lock. Those beyond max_num_seqs (where the pool holds back the queue's head, more wait).
        held = self._num_running + self._num_waiting + self._num_inbox_adds + count
        return max(0, held - self.engine.config.max_num_seqs)

    # The caller's side (any thread with an event loop).

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, *, timeout: float | None = None,
                          priority: int = 0) -> RequestStream:
        """Hand a request to the engine; returns its stream once the engine has accepted it.

        Raises what LLMEngine.add_request raises for a bad request (ValueError, TypeError), QueueFullError
        when the waiting queue is full, EngineDeadError when the loop has stopped. timeout: seconds from
        now until the stream ends the request with finish_reason "timeout". priority: as
        LLMEngine.add_request takes it (scheduling_policy "priority": lower runs first).
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        request_id = uuid.uuid4().hex if request_id is None else request_id
        with self._lock:
            waiting = self._queued()
            if self.max_num_queued_reqs is not None and waiting >= self.max_num_queued_reqs:
                raise QueueFullError(waiting, retry_after=self._mean_queue_time)
            self._num_inbox_adds += 1
        stream = RequestStream(self, request_id, params, () if isinstance(prompt, str) else prompt, loop,
                               None if timeout is None else loop.time() + timeout)
        self._inbox.put(_Add(request_id, prompt, params, stream, priority))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self._abort(request_id, "abort")
            raise
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, *, timeout: float | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving the loop early (or aclose()) aborts it."""
        stream = await self.add_request(prompt, params, request_id, timeout=timeout, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine), run on the loop's thread between two steps (the engine is not thread-safe), and
        what it returns or raises. The next step waits for it: keep it quick."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(fn, future))
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks before the next step; its stream ends with finish_reason
        "abort". Unknown ids are ignored."""
        self._abort(request_id, "abort")

    def _abort(self, request_id: str, reason: str) -> None:
        self._inbox.put(_Abort(request_id, reason))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop: requests still running end with finish_reason "abort"."""
        self._stopping = True
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    # The loop's side.

    def _run(self) -> None:
        idle_wait = 0
        try:
            while self._take_commands(idle_wait if self.engine.has_unfinished_requests() else None):
                ran = self.engine.has_unfinished_requests() and self._step()
                idle_wait = 0 if ran else _IDLE_WAIT_S
                self._expire_queued()
                self._publish()
        except BaseException:
            log.exception("the engine loop failed")
            raise
        finally:
            self._stopping = True
            self._end_all()

    def _take_commands(self, wait: float | None) -> bool:
        """Run the inbox's commands, waiting up to `wait` seconds for the first (None: as long as it
        takes, 0: not at all). False once told to stop."""
        self._iteration = IterationStats()
        try:
            command = self._inbox.get(timeout=wait) if wait != 0 else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while command is not _STOP:
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Call):
                self._run_call(command)
            else:
                self._drop(command.request_id, command.reason)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                # Show the new state before the step, which may take long (a compile, say).
                self.scheduler_stats = self._scheduler_stats()
                return True
        return False

    def _add(self, command: _Add) -> None:
        stream = command.stream
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id, command.priority)
        except Exception as e:  # the request's own fault (a bad prompt, a tokenizer error): it fails alone
            error = e
        else:
            error = None
            # A text prompt's length is known once its first output shows the token ids.
            prompt_len = 0 if isinstance(command.prompt, str) else len(command.prompt)
            self._live[command.request_id] = _Live(stream, stream._arrival, command.params, prompt_len)
        with self._lock:
            self._num_inbox_adds -= 1
            self._num_waiting += error is None
        self._call(stream, _settle, stream.accepted, error)

    def _run_call(self, command: _Call) -> None:
        try:
            result, error = command.fn(self.engine), None
        except Exception as e:
            result, error = None, e
        _reply(command.future, error, result)

    def _expire_queued(self) -> None:
        """End the requests that have waited for their first admission longer than max_queue_time."""
        if self.max_queue_time is None:
            return
        arrived_before = time.monotonic() - self.max_queue_time
        for request_id in [i for i, live in self._live.items() if not live.scheduled and live.arrival < arrived_before]:
            self._drop(request_id, "queue_timeout")

    def _drop(self, request_id: str, reason: str) -> None:
        """Abort a request the loop holds; its blocks are free before the next step, and its stream
        ends with `reason` (a stream that already ended, by close() or its deadline, ignores it)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        self.engine.abort_request(request_id)
        self._iteration.finished.append(live.finished(reason, time.monotonic()))
        self._call(live.stream, live.stream._put, reason)

    def _step(self) -> bool:
        """One engine step; whether it ran any token."""
        start = time.monotonic()
        tokens_before = self.engine.num_batched_tokens
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed: ending the %d requests in flight", len(self._live))
            self._fail_all(e)
            outputs = []
        now = time.monotonic()
        it = self._iteration
        it.step_time = now - start
        it.num_batched_tokens = self.engine.num_batched_tokens - tokens_before
        self._note_admissions(start)
        posts = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            self._observe(live, out, now)
            posts.append((live.stream, out))
            if out.finished:
                del self._live[out.request_id]
                reasons = [c.finish_reason for c in out.outputs]
                it.finished.append(live.finished("error" if "error" in reasons else reasons[0], now))
        self._post(posts)
        return it.num_batched_tokens > 0

    def _observe(self, live: _Live, out: RequestOutput, now: float) -> None:
        it = self._iteration
        generated = sum(len(c.token_ids) for c in out.outputs)
        if generated <= live.num_generation_tokens:
            return
        if live.last_token_time is None:
            live.num_prompt_tokens = len(out.prompt_token_ids)
            it.time_to_first_tokens.append(now - live.arrival)
            it.num_prompt_tokens += live.num_prompt_tokens
        else:
            it.inter_token_latencies.append(now - live.last_token_time)
        it.num_generation_tokens += generated - live.num_generation_tokens
        live.num_generation_tokens, live.last_token_time = generated, now

    def _waiting_ids(self) -> set[str]:
        # A constrained request whose grammar still compiles waits too, outside the scheduler.
        return {seq.request_id for seq in self.engine.scheduler.waiting} | self.engine.awaiting_grammar.request_ids

    def _note_admissions(self, step_start: float) -> None:
        """Requests that left the waiting queue in this step: their time in it."""
        waiting = self._waiting_ids()
        for request_id, live in self._live.items():
            if not live.scheduled and request_id not in waiting:
                live.scheduled = True
                queued = step_start - live.arrival
                self._iteration.queue_times.append(queued)
                self._mean_queue_time = 0.8 * self._mean_queue_time + 0.2 * queued

    def _fail_all(self, error: Exception) -> None:
        """The step raised: end every request in flight with the error, and keep serving."""
        failure = EngineStepError(f"the engine failed while running this request ({type(error).__name__}: {error})")
        now = time.monotonic()
        posts = []
        for request_id, live in self._live.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("could not abort request %s after the failed step", request_id)
            posts.append((live.stream, failure))
            self._iteration.finished.append(live.finished("error", now))
        self._live.clear()
        self._post(posts)

    def _end_all(self) -> None:
        """On stop: running requests end with "abort", requests still in the inbox are refused."""
        for request_id in list(self._live):
            self._drop(request_id, "abort")
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._call(command.stream, _settle, command.stream.accepted, EngineDeadError("the engine stopped"))
            elif isinstance(command, _Call):
                _reply(command.future, EngineDeadError("the engine stopped"))
        self._publish()

    def _post(self, posts: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        """Hand outputs to their streams: one wake-up per event loop, not one per request."""
        by_loop = collections.defaultdict(list)
        for stream, item in posts:
            by_loop[stream.loop].append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the callers' event loop is closed: nobody reads these any more
                for stream, _ in batch:
                    self._drop(stream.request_id, "abort")

    def _call(self, stream: RequestStream, fn, *args) -> None:
        try:
            stream.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            self._drop(stream.request_id, "abort")

    def _scheduler_stats(self) -> SchedulerStats:
        engine, blocks = self.engine, self.engine.blocks
        stats = engine.stats()
        waiting = len(self._waiting_ids())
        running = engine.num_unfinished_requests - waiting
        with self._lock:
            self._num_running, self._num_waiting = running, waiting
            queued = waiting + self._num_inbox_adds
        return SchedulerStats(
            num_running=running, num_waiting=queued,
            num_blocks=blocks.num_blocks - 1, num_free_blocks=blocks.num_free, num_cached_blocks=blocks.num_evictable,
            num_preemptions=stats.num_preemptions,
            prefix_cache_queries=stats.prefix_cache_queried_blocks * blocks.block_size,
            prefix_cache_hits=stats.prefix_cache_hit_blocks * blocks.block_size,
            num_compiles=stats.num_compiles, num_batched_tokens=stats.num_batched_tokens)

    def _publish(self) -> None:
        self.scheduler_stats = self._scheduler_stats()
        for logger in self._stat_loggers:
            try:
                logger.record(self.scheduler_stats, self._iteration)
            except Exception:
                log.exception("stat logger %r failed", logger)


def _settle(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def _reply(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    """From the loop's thread: settle a future of another thread's event loop."""
    with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits
        future.get_loop().call_soon_threadsafe(_settle, future, error, result)


def _put_all(batch: list[tuple[RequestStream, object]]) -> None:
    for stream, item in batch:
        stream._put(item)


AsyncLLM = AsyncLLMEngine
