"""KV-cache events as vLLM publishes them (`--kv-events-config`), so a prefix-aware router (llm-d's
KV-cache indexer, the Gateway API Inference Extension's precise prefix scorer) knows which blocks each
replica holds and sends a request where most of its prompt is already computed.

The prefix cache logs what it stores, evicts and clears (core/prefix_cache.py, its `events` list); the
engine loop drains that log after every iteration (KVEventDrain, a StatLogger, on the loop's thread)
and hands it to a ZMQ publisher whose own thread encodes and sends it, so a step never waits on a socket.

The wire format is vLLM's (vllm/distributed/kv_events.py, msgspec structs with array_like=True and
tag=True), reproduced with plain msgpack: each message is three frames, the topic, a sequence number
(8 bytes, big-endian, from 0) and the payload, an EventBatch `[ts, events, data_parallel_rank]`, whose
events are each a tagged array:

    ["BlockStored", block_hashes, parent_block_hash | None, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

A BlockStored carries a run of blocks that chain one to the next, and the token ids of them all
(block_size for each). Hashes go out as unsigned 64-bit ints (our names are Python's signed hashes),
which subscribers written in Go decode as uint64. `medium` is "GPU", vLLM's name for the tier every
block of ours lives in, the device's KV cache, whatever the device. With `replay_endpoint`, a ROUTER
socket answers a request for the batches from a sequence number on, as vLLM's does: a subscriber that
joined late or lost messages sends `[b"", start.to_bytes(8, "big")]` (a REQ or DEALER socket) and gets
back `[seq, payload]` for each batch still buffered, then `[-1 (8 bytes, signed), b""]`.
"""

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque

import msgpack
import zmq

from paged_jax.core.prefix_cache import ROOT_HASH, CacheEvent, PrefixCache
from paged_jax.serving.stats import IterationStats, SchedulerStats, StatLogger

log = logging.getLogger(__name__)
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_UINT64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's --kv-events-config, by its JSON keys."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq", or "null" to publish nothing
    endpoint: str = "tcp://*:5557"  # bound when it has "*", "::", ipc:// or inproc://, else connected to
    replay_endpoint: str | None = None  # bound: a ROUTER that resends buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""

    def __post_init__(self):
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events publisher must be 'zmq' or 'null', got {self.publisher!r}")

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        values = json.loads(text)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown --kv-events-config keys: {', '.join(sorted(unknown))}")
        return cls(**values)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def external_hash(name: int) -> int:
    """A block's name as it goes on the wire: unsigned 64-bit."""
    return name & _UINT64


def wire_events(events: list[CacheEvent], block_size: int) -> list[list]:
    """The prefix cache's log as vLLM's tagged event arrays; stored names that chain become one event."""
    out: list[list] = []
    for event in events:
        if event[0] == "stored":
            name = event[1]
            last = out[-1] if out else None
            if last is not None and last[0] == "BlockStored" and last[1][-1] == external_hash(name.parent):
                last[1].append(external_hash(name))
                last[3].extend(name.token_ids)
            else:
                parent = None if name.parent == ROOT_HASH else external_hash(name.parent)
                out.append(["BlockStored", [external_hash(name)], parent, list(name.token_ids), block_size, None,
                            MEDIUM])
        elif event[0] == "removed":
            out.append(["BlockRemoved", [external_hash(n) for n in event[1]], MEDIUM])
        else:
            out.append(["AllBlocksCleared"])
    return out


class ZmqPublisher:
    """A PUB socket (and a replay ROUTER) served by a thread of its own; publish() only enqueues."""

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0):
        self.config, self.block_size, self.rank = config, block_size, data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[CacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        context = zmq.Context.instance()
        self._pub = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if bind:
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, ts: float, events: list[CacheEvent]) -> None:
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:  # a subscriber that cannot keep up loses batches, never the engine its step
            log.warning("KV-event queue full: a batch of %d events dropped (replay cannot resend it)", len(events))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        topic, seq = self.config.topic.encode(), 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = msgpack.packb([ts, wire_events(events, self.block_size), self.rank])
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("malformed KV-event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


class KVEventDrain(StatLogger):
    """After each loop iteration, on the loop's thread: take the prefix cache's log and publish it."""

    def __init__(self, cache: PrefixCache, publisher: ZmqPublisher):
        self.cache, self.publisher = cache, publisher
        cache.events = []

    @classmethod
    def start(cls, engine, config: KVEventsConfig | None) -> "KVEventDrain | None":
        """Publishing for `engine` (an LLMEngine) as `config` asks, or None (no events asked for)."""
        if config is None or not config.publishes:
            return None
        cache = engine.blocks.cache
        if cache is None:
            raise ValueError("KV-cache events need prefix caching (--enable-prefix-caching)")
        return cls(cache, ZmqPublisher(config, engine.resolved.block_size))

    def close(self) -> None:
        self.cache.events = None
        self.publisher.close()

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        if self.cache.events:
            events, self.cache.events = self.cache.events, []
            self.publisher.publish(time.time(), events)
