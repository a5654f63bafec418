"""KV-cache events as a prefix-aware router receives them: a subscriber written from vLLM's published
format alone (ZMQ frames topic, sequence number, msgpack EventBatch of tagged arrays; decoded with plain
msgpack, nothing of ours) follows two replicas through a mixed workload (prompts sharing prefixes, a
pool small enough to evict, a reset) and its picture of each replica's blocks equals that replica's
prefix cache."""

import asyncio
import concurrent.futures
import contextlib
import time

import httpx
import msgpack
import pytest
import zmq

from conftest import running_server
from paged_jax import EngineConfig, LLMEngine
from paged_jax.serving.cli import parse_args
from paged_jax.serving.kv_events import KVEventsConfig
from paged_jax.serving.server import ServerConfig, build_app

MODEL = "tiny"
TIMEOUT = 300.0  # generous: the test checks what the servers say, never how fast they say it
BLOCK = 16
# 23 usable blocks of 16 tokens: the workload below needs more, so cached blocks are evicted.
ENGINE = dict(block_size=BLOCK, num_blocks=24, max_num_seqs=2, max_num_batched_tokens=128, max_model_len=160)


class Subscriber:
    """A router's picture of what each replica holds, rebuilt from its events alone."""

    def __init__(self, replicas: dict[bytes, tuple[str, str]]):
        """replicas: topic -> (PUB endpoint, replay endpoint)."""
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        for endpoint, _ in replicas.values():
            self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.replay_endpoints = {topic: replay for topic, (_, replay) in replicas.items()}
        self.held = {topic: set() for topic in replicas}
        self.tokens: dict[bytes, dict[int, list[int]]] = {topic: {} for topic in replicas}  # hash -> its tokens
        self.next_seq = dict.fromkeys(replicas, 0)
        self.counts = {topic: {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0} for topic in replicas}

    def poll(self, timeout_ms: int) -> None:
        """Apply what arrives within timeout_ms; a gap in a replica's sequence is filled by replay, and
        so is a quiet spell (whatever was published before the subscription took hold)."""
        if not self.sub.poll(timeout_ms):
            for topic in self.held:
                self.replay(topic)
        while self.sub.poll(0):
            topic, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq[topic]:  # joined late (ZMQ's slow joiner) or lost some: ask for them
                self.replay(topic)
            if seq == self.next_seq[topic]:
                self.apply(topic, payload)

    def replay(self, topic: bytes) -> None:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoints[topic])
        dealer.send_multipart([b"", self.next_seq[topic].to_bytes(8, "big")])
        while True:
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            if int.from_bytes(seq, "big") == self.next_seq[topic]:
                self.apply(topic, payload)
        dealer.close(linger=0)

    def apply(self, topic: bytes, payload: bytes) -> None:
        ts, events, data_parallel_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and data_parallel_rank == 0
        for event in events:
            tag, *fields = event
            self.counts[topic][tag] += 1
            if tag == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium = fields
                assert block_size == BLOCK and len(token_ids) == BLOCK * len(hashes)
                assert lora_id is None and medium == "GPU" and (parent is None or parent >= 0)
                self.held[topic].update(hashes)
                for i, h in enumerate(hashes):
                    self.tokens[topic][h] = token_ids[i * BLOCK : (i + 1) * BLOCK]
            elif tag == "BlockRemoved":
                hashes, medium = fields
                assert medium == "GPU" and set(hashes) <= self.held[topic]  # only what it was told of
                self.held[topic].difference_update(hashes)
            else:
                assert tag == "AllBlocksCleared" and fields == []
                self.held[topic].clear()
        self.next_seq[topic] += 1


@pytest.fixture(scope="module")
def replicas(tiny_chat_model, tmp_path_factory):
    """Two servers publishing events, each on its own topic: {topic: (base URL, app, endpoints)}."""
    folder = tmp_path_factory.mktemp("kv-events")
    with contextlib.ExitStack() as stack:
        out = {}
        for name in ("a", "b"):
            endpoints = (f"ipc://{folder}/{name}.pub", f"ipc://{folder}/{name}.replay")
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoints[0],
                                    replay_endpoint=endpoints[1], topic=f"replica-{name}")
            engine = LLMEngine(tiny_chat_model.model, tiny_chat_model.config, tiny_chat_model.tokenizer,
                               EngineConfig(**ENGINE))
            app = build_app(engine, ServerConfig(served_model_name=MODEL, kv_events=events))
            out[f"replica-{name}".encode()] = (stack.enter_context(running_server(app)), app, endpoints)
        yield out


def complete(base: str, prompt: list[int]) -> None:
    r = httpx.post(f"{base}/v1/completions", timeout=TIMEOUT, json=dict(
        model=MODEL, prompt=prompt, max_tokens=8, ignore_eos=True, temperature=0))
    assert r.status_code == 200, r.text


def own_picture(app) -> set[int]:
    """The replica's prefix cache, its names as they go on the wire (unsigned 64-bit), between steps."""
    names = lambda engine: {n & (2**64 - 1) for n in engine.blocks.cache.names()}
    return asyncio.run(app.state.engine.call(names))


def test_a_subscriber_rebuilds_each_replicas_blocks_from_its_events(replicas):
    subscriber = Subscriber({topic: endpoints for topic, (_, _, endpoints) in replicas.items()})
    system = list(range(300, 348))  # a 48-token system prompt that requests share: 3 blocks
    (a, app_a, _), (b, app_b, _) = replicas.values()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        # Shared prefixes on both replicas, then distinct long prompts on A, more than its pool holds.
        list(pool.map(lambda i: complete(a, system + [1000 + i] * 20), range(4)))
        list(pool.map(lambda i: complete(b, system + [2000 + i] * 20), range(3)))
        list(pool.map(lambda i: complete(a, [3000 + 7 * i + j for j in range(90)]), range(6)))
        asyncio.run(app_a.state.engine.call(lambda engine: engine.blocks.reset_prefix_cache()))
        list(pool.map(lambda i: complete(a, system + [4000 + i] * 30), range(3)))
        list(pool.map(lambda i: complete(b, [5000 + 3 * i + j for j in range(70)]), range(3)))

    expected = {topic: own_picture(app) for topic, (_, app, _) in replicas.items()}
    deadline = time.monotonic() + TIMEOUT
    while subscriber.held != expected:
        assert time.monotonic() < deadline, "the subscriber's picture never matched the replicas' prefix caches"
        subscriber.poll(100)
    a_counts, b_counts = subscriber.counts.values()
    assert a_counts["BlockRemoved"] > 0 and a_counts["AllBlocksCleared"] == 1  # evicted, and reset
    assert b_counts["AllBlocksCleared"] == 0 and subscriber.held[b"replica-a"] != subscriber.held[b"replica-b"]
    # A stored block carries its tokens: the shared system prompt's first block is there on B.
    assert system[:BLOCK] in subscriber.tokens[b"replica-b"].values()


def test_the_flag_takes_vllms_json(capsys):
    flag = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    config = parse_args(["--kv-events-config", flag]).server_config.kv_events
    assert config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv") and config.publishes
    for bad in ('{"enable_kv_cache_events": true, "publisher": "kafka"}', '{"enable": true}', "{"):
        with pytest.raises(SystemExit):
            parse_args(["--kv-events-config", bad])
        assert "error:" in capsys.readouterr().err  # argparse's message, not a traceback
