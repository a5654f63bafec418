"""What callers hand the engine loop (engine_loop.py) through its inbox, and the errors it answers with."""

import asyncio
import dataclasses
from collections.abc import Callable

from paged_jax.core.engine import LLMEngine
from paged_jax.core.lora_request import LoRARequest
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.serving.request_stream import RequestStream


class QueueFullError(RuntimeError):
    """The engine already holds as many waiting requests as it was allowed: try again later."""

    def __init__(self, num_waiting: int, retry_after: float):
        super().__init__(f"{num_waiting} requests are already waiting, the most this server queues; retry later")
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or died): no request can run."""


class EngineStepError(RuntimeError):
    """The engine step that ran this request raised; the request ended with it."""


@dataclasses.dataclass(frozen=True)
class Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: RequestStream
    priority: int
    lora_request: LoRARequest | None = None


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str  # "abort" or "timeout", for the metrics


@dataclasses.dataclass(frozen=True)
class Call:
    fn: Callable[[LLMEngine], object]
    future: asyncio.Future
