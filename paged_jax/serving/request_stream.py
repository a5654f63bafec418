"""RequestStream: one request's outputs, handed from the engine's thread to the event loop its caller
waits on, as its SamplingParams.output_kind asks.

The engine hands the stream what is new in each step (DELTA outputs). Deltas that arrive while the
reader is busy are folded into one, so a reader that falls behind gets everything in its next output
and nothing queues up behind a slow client. A CUMULATIVE reader gets the whole so far each time, a
FINAL_ONLY reader the finished output alone.
"""

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence

from paged_jax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.core.sampling_params import RequestOutputKind, SamplingParams


def engine_params(params: SamplingParams) -> SamplingParams:
    """What the stream asks of the engine for a caller's params: DELTA outputs. Beam search, whose
    beams have no deltas, gives its final output only (and refuses a caller's DELTA, as the engine does)."""
    if not params.use_beam_search:
        return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    if params.output_kind is RequestOutputKind.DELTA:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


class RequestStream:
    """One request's outputs, an async iterator of RequestOutput that ends after the finished one.

    At its deadline the stream aborts the request and ends with an output whose unfinished samples say
    finish_reason "timeout". close() aborts the request if it has not finished.
    """

    def __init__(self, engine, request_id: str, params: SamplingParams, prompt_token_ids: Sequence[int],
                 loop: asyncio.AbstractEventLoop, deadline: float | None):
        """engine: the AsyncLLMEngine, told of aborts; deadline: in loop.time(), None waits for ever."""
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future = loop.create_future()  # set once the engine has checked the request
        self.arrival_time = time.monotonic()  # the request's one arrival time, handed to the engine
        self._engine = engine
        self._params = params
        self._deadline = deadline
        self._pending: RequestOutput | BaseException | None = None  # not handed out yet, deltas folded
        self._whole: RequestOutput | None = None  # everything handed out, for a CUMULATIVE reader
        self._ready = asyncio.Event()
        self._done = False
        # What the deltas have said so far: enough to end the request in their terms (_ended).
        self._header: tuple[str | None, list[int]] = (None, list(prompt_token_ids))
        self._metrics: RequestMetrics | None = None
        self._cumulative_logprobs: dict[int, float | None] = {}
        self._finished_samples: set[int] = set()

    def _put(self, item: RequestOutput | BaseException | str) -> None:
        """On the event loop: the engine's newest delta, an error, or the reason it ended the request."""
        if self._done or isinstance(self._pending, BaseException):
            return
        if isinstance(item, str):
            item = self._ended(item)
        if isinstance(item, BaseException) or self._pending is None:
            self._pending = item
        else:
            self._pending.add(item)
        if isinstance(item, RequestOutput):
            self._note(item)
            if self._params.output_kind is RequestOutputKind.FINAL_ONLY and not item.finished:
                return
        self._ready.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            async with asyncio.timeout_at(self._deadline):
                await self._ready.wait()
        except TimeoutError:
            self._engine._abort(self.request_id, "timeout")
            self._put("timeout")
        item, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        if self._params.output_kind is not RequestOutputKind.CUMULATIVE:
            return item
        if self._whole is None:
            self._whole = item
        else:
            self._whole.add(item)
        # A copy: the whole grows on, and what a reader holds must not.
        return dataclasses.replace(self._whole, outputs=[c.copy() for c in self._whole.outputs])

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine._abort(self.request_id, "abort")

    def _note(self, delta: RequestOutput) -> None:
        self._header = (delta.prompt, delta.prompt_token_ids)
        self._metrics = delta.metrics
        for c in delta.outputs:
            self._cumulative_logprobs[c.index] = c.cumulative_logprob
            if c.finished:
                self._finished_samples.add(c.index)

    def _ended(self, reason: str) -> RequestOutput:
        """The delta that ends the request: every sample still running finishes with `reason`."""
        logprobs = [] if self._params.logprobs is not None else None
        completions = [CompletionOutput(i, "", [], self._cumulative_logprobs.get(i), logprobs, reason)
                       for i in range(max(self._params.n, len(self._cumulative_logprobs)))
                       if i not in self._finished_samples]
        now = time.monotonic()
        metrics = (RequestMetrics(self.arrival_time, None, now, 0, 0, 0) if self._metrics is None
                   else dataclasses.replace(self._metrics, finish_time=now))
        return RequestOutput(self.request_id, *self._header, completions, True, metrics)


def post(posts: list[tuple[RequestStream, RequestOutput | BaseException | str]]) -> list[RequestStream]:
    """From the engine's thread: hand outputs to their streams, one wake-up per event loop rather than
    one per request. Returns the streams whose event loop is closed."""
    by_loop = collections.defaultdict(list)
    for stream, item in posts:
        by_loop[stream.loop].append((stream, item))
    orphans = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            orphans += [stream for stream, _ in batch]
    return orphans


def settle(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    """On the event loop: a request's acceptance (error None) or refusal; a call's result or error."""
    if not future.done():
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def reply(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    """From the engine's thread: settle a future of another thread's event loop."""
    with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody waits
        future.get_loop().call_soon_threadsafe(settle, future, error, result)


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException | str]]) -> None:
    for stream, item in batch:
        stream._put(item)
