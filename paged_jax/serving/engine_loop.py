"""EngineLoop: the one thread that owns an LLMEngine, which is not thread-safe.

It loops: run the commands in its inbox (add, abort, stop), run one step, hand what each request
gained to the event loop its caller waits on (request_stream.py), count what happened for the stat
loggers (stats.py). It uses only the engine's narrow surface (engine.py): its limits, add_request,
abort_request, has_unfinished_requests, step and stats().
"""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

from paged_jax.core import warmup
from paged_jax.core.engine import LLMEngine
from paged_jax.core.outputs import RequestOutput
from paged_jax.serving import prefill_clock
from paged_jax.serving.loop_commands import Abort, Add, Call, EngineDeadError, EngineStepError, QueueFullError
from paged_jax.serving.request_stream import RequestStream, engine_params, post, reply, settle
from paged_jax.serving.stats import (FinishedRequestStats, IterationStats, RequestTally, SchedulerStats, StatLogger,
                                     scheduler_stats)

log = logging.getLogger(__name__)

# How long the loop waits for commands when the engine holds requests but could schedule none of them.
_IDLE_WAIT_S = 0.01


_STOP = object()


@dataclasses.dataclass(eq=False)
class _Live:
    """A request the engine holds: its stream and what the loop has counted of it."""

    stream: RequestStream
    tally: RequestTally

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        return self.tally.finished(reason, self.stream.arrival_time, now)


class EngineLoop:
    def __init__(self, engine: LLMEngine, max_num_queued_reqs: int | None, max_queue_time: float | None,
                 stat_loggers: Sequence[StatLogger], warm_up: bool, probe_prefill: bool = False):
        """max_num_queued_reqs, max_queue_time, warm_up, probe_prefill: see AsyncLLMEngine."""
        self.engine = engine
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_queue_time = max_queue_time
        self._max_num_seqs = engine.limits.max_num_seqs
        self._stat_loggers = list(stat_loggers)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # The queue cap is checked on the callers' side and kept on the loop's: both under the lock.
        self._lock = threading.Lock()
        self._num_held = 0  # requests the engine holds
        self._num_inbox_adds = 0  # requests accepted into the inbox, not yet handed to the engine
        self._mean_queue_time = 1.0  # recent time to admission (s), what a rejected caller is told to wait
        self._live: dict[str, _Live] = {}  # loop thread only
        self._iteration = IterationStats()
        self.stopping = False
        self._warm_up = warm_up
        self._probe_prefill = probe_prefill
        self.warmed = threading.Event()
        self._engine_stats = engine.stats()
        self.scheduler_stats: SchedulerStats = self._scheduler_stats()
        self.thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
        self.thread.start()

    # Any thread.

    def add(self, command: Add) -> None:
        """Queue an add, or raise QueueFullError: a request counts as waiting once those ahead of it
        fill max_num_seqs, so a burst into an idle engine is not refused."""
        with self._lock:
            waiting = self._queued()
            if self.max_num_queued_reqs is not None and waiting >= self.max_num_queued_reqs:
                raise QueueFullError(waiting, retry_after=self._mean_queue_time)
            self._num_inbox_adds += 1
        self._inbox.put(command)

    def queue_position(self, count: int = 1) -> int:
        """Where the last of `count` requests added now would stand in the waiting queue (1: first in
        line; 0: admitted at once, as far as max_num_seqs goes)."""
        with self._lock:
            return self._queued(count)

    def _queued(self, count: int = 0) -> int:
        # Under the lock. Those beyond max_num_seqs (where the pool holds back the queue's head, more wait).
        return max(0, self._num_held + self._num_inbox_adds + count - self._max_num_seqs)

    def abort(self, request_id: str, reason: str) -> None:
        self._inbox.put(Abort(request_id, reason))

    def call(self, command: Call) -> None:
        self._inbox.put(command)

    def stop(self, timeout: float | None) -> None:
        self.stopping = True
        self._inbox.put(_STOP)
        self.thread.join(timeout)

    # The loop's thread.

    def _run(self) -> None:
        idle_wait = 0
        try:
            if self._warm_up:
                warmup.warm_up(self.engine)
                if self._probe_prefill:  # the probe's step is the first iteration the loggers see
                    self._iteration.step_time, _ = prefill_clock.probe(self.engine)
                self._publish()  # the warm-up's programs, counted before anything else runs
            self.warmed.set()
            while self._take_commands(idle_wait if self.engine.has_unfinished_requests() else None):
                if self.engine.has_unfinished_requests():
                    self._step()
                self._expire_queued()
                self._publish()
                idle_wait = 0 if self._iteration.num_batched_tokens else _IDLE_WAIT_S
        except BaseException:
            log.exception("the engine loop failed")
            raise
        finally:
            self.stopping = True
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
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, Call):
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

    def _add(self, command: Add) -> None:
        stream = command.stream
        try:
            self.engine.add_request(command.prompt, engine_params(command.params), command.request_id,
                                    command.priority, stream.arrival_time, command.lora_request)
        except Exception as e:  # the request's own fault (a bad prompt, a tokenizer error): it fails alone
            error = e
        else:
            error = None
            # A text prompt's length is known once its first output shows the token ids.
            tally = RequestTally(command.params.max_tokens, command.params.n,
                                 0 if isinstance(command.prompt, str) else len(command.prompt))
            self._live[command.request_id] = _Live(stream, tally)
        with self._lock:
            self._num_inbox_adds -= 1
            self._num_held += error is None
        self._call(stream, settle, stream.accepted, error)

    def _run_call(self, command: Call) -> None:
        try:
            result, error = command.fn(self.engine), None
        except Exception as e:
            result, error = None, e
        reply(command.future, error, result)

    def _expire_queued(self) -> None:
        """End the requests that have waited for their first admission longer than max_queue_time."""
        if self.max_queue_time is None:
            return
        arrived_before = time.monotonic() - self.max_queue_time
        for request_id in [i for i, live in self._live.items()
                           if not live.tally.scheduled and live.stream.arrival_time < arrived_before]:
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

    def _step(self) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed: ending the %d requests in flight", len(self._live))
            self._fail_all(e)
            outputs = []
        now = time.monotonic()
        it = self._iteration
        it.step_time = now - start
        posts = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            queued = live.tally.observe(out, live.stream.arrival_time, now, it)
            if queued is not None:
                self._mean_queue_time = 0.8 * self._mean_queue_time + 0.2 * queued
            posts.append((live.stream, out))
            if out.finished:
                del self._live[out.request_id]
                reasons = [c.finish_reason for c in out.outputs]
                it.finished.append(live.finished("error" if "error" in reasons else reasons[0], now))
        self._post(posts)

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
            if isinstance(command, Add):
                self._call(command.stream, settle, command.stream.accepted, EngineDeadError("the engine stopped"))
            elif isinstance(command, Call):
                reply(command.future, EngineDeadError("the engine stopped"))
        self._publish()

    def _post(self, posts: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
        for stream in post(posts):  # their event loop is closed: nobody reads these any more
            self._drop(stream.request_id, "abort")

    def _call(self, stream: RequestStream, fn, *args) -> None:
        try:
            stream.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            self._drop(stream.request_id, "abort")

    def _scheduler_stats(self) -> SchedulerStats:
        stats = self._engine_stats = self.engine.stats()
        with self._lock:
            self._num_held = stats.num_running_requests + stats.num_waiting_requests
            queued = stats.num_waiting_requests + self._num_inbox_adds
        return scheduler_stats(stats, queued)

    def _publish(self) -> None:
        # Counters as differences of the engine's stats, read once an iteration: since the last read,
        # which _take_commands makes before the step when commands came.
        before, it = self._engine_stats, self._iteration
        self.scheduler_stats = self._scheduler_stats()
        it.num_batched_tokens = self._engine_stats.num_batched_tokens - before.num_batched_tokens
        if it.step_time is not None:
            it.device_time = self._engine_stats.device_seconds - before.device_seconds
            it.host_time = it.step_time - it.device_time
        for logger in self._stat_loggers:
            try:
                logger.record(self.scheduler_stats, self._iteration)
            except Exception:
                log.exception("stat logger %r failed", logger)
