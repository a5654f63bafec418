"""How a response comes out of its engine requests' streams: server-sent events for a streamed one
(ended by `data: [DONE]`, a failure midway becoming an error event), or each stream's final output."""

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

from pydantic import BaseModel

from paged_jax.core.outputs import RequestOutput
from paged_jax.serving.loop_commands import EngineStepError
from paged_jax.serving.openai_errors import APIError, engine_error
from paged_jax.serving.request_stream import RequestStream

log = logging.getLogger(__name__)


def sse(payload: BaseModel) -> str:
    """One server-sent event."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclasses.dataclass
class EventStream:
    """A streamed response: its events, and close() to end its requests if the events are not read to
    the end (the client left before the first event, say)."""

    events: AsyncIterator[str]
    streams: list[RequestStream]

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


async def ending(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then `data: [DONE]`. A failure midway (the status line has gone out) becomes an
    error event: this request fails alone, the server carries on."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except EngineStepError as e:
        yield sse(engine_error(e).response())
    except APIError as e:  # after the status line: a queue timeout (slo.py), say
        yield sse(e.response())
    except Exception as e:
        log.exception("a streamed response failed")
        yield sse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").response())
    yield "data: [DONE]\n\n"


async def finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's finished output. An engine failure (raised, or finish_reason "error") or a timeout
    is an APIError; the streams are closed whatever happens (so a cancelled caller aborts its requests)."""

    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        return out

    try:
        outputs = await asyncio.gather(*map(last, streams))
    except EngineStepError as e:
        raise engine_error(e) from e
    finally:
        for stream in streams:
            stream.close()
    if any(c.finish_reason == "error" for f in outputs for c in f.outputs):
        raise APIError(500, "the engine failed while running this request", type="server_error", code="engine_error")
    timed_out = [f for f in outputs if any(c.finish_reason == "timeout" for c in f.outputs)]
    if timed_out:
        elapsed = timed_out[0].metrics.finish_time - timed_out[0].metrics.arrival_time
        raise APIError(408, f"the request ran out of time after {elapsed:.1f} s, with "
                       f"{sum(len(c.token_ids) for c in timed_out[0].outputs)} tokens generated",
                       type="timeout_error", param="request_timeout", code="request_timeout")
    return outputs


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
