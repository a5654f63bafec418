"""Prefix-aware placement from vLLM's KV-cache events: a demonstration of what the events give a router
(llm-d's KV-cache indexer, the Gateway API Inference Extension's precise prefix scorer), not a product.

It subscribes to each replica's PUB socket (`--kv-events-config`) and decodes vLLM's published format with
plain msgpack: frames (topic, seq, EventBatch [ts, events, dp_rank]), events tagged arrays
["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ["BlockRemoved", hashes, medium],
["AllBlocksCleared"]. It never recomputes a replica's hash: a block is known by (its parent's hash, its
tokens), a token trie per replica, so a request's prompt tokens walk it block by block.
"""

import threading

import msgpack
import zmq


class PrefixRouter:
    def __init__(self, endpoints: list[str]):
        """endpoints: each replica's KV-event PUB endpoint, in the caller's replica order."""
        self.held = [{} for _ in endpoints]  # per replica: (parent hash, tokens) -> hash
        self.keys = [{} for _ in endpoints]  # per replica: hash -> (parent hash, tokens)
        self.block_size, self.lock = None, threading.Lock()
        self.subs = [zmq.Context.instance().socket(zmq.SUB) for _ in endpoints]
        for sub, endpoint in zip(self.subs, endpoints):
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        poller = zmq.Poller()
        for sub in self.subs:
            poller.register(sub, zmq.POLLIN)
        while True:
            for sub, _ in poller.poll():
                _topic, _seq, payload = sub.recv_multipart()
                with self.lock:
                    self.apply(self.subs.index(sub), msgpack.unpackb(payload)[1])

    def apply(self, replica: int, events: list) -> None:
        held, keys = self.held[replica], self.keys[replica]
        for tag, *fields in events:
            if tag == "BlockStored":
                hashes, parent, token_ids, self.block_size = fields[:4]
                for i, h in enumerate(hashes):  # a run of blocks, each the next one's parent
                    keys[h] = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
                    held[keys[h]], parent = h, h
            elif tag == "BlockRemoved":
                for h in fields[0]:
                    held.pop(keys.pop(h, None), None)
            else:  # AllBlocksCleared
                held.clear()
                keys.clear()

    def matched_blocks(self, replica: int, token_ids: list[int]) -> int:
        """How many leading full blocks of token_ids the replica holds."""
        n, parent, size = 0, None, self.block_size or 1 << 30
        while (n + 1) * size <= len(token_ids):
            parent = self.held[replica].get((parent, tuple(token_ids[n * size : (n + 1) * size])))
            if parent is None:
                break
            n += 1
        return n

    def pick(self, token_ids: list[int], load: list[int]) -> int:
        """The replica holding the longest prefix of token_ids; ties to the least loaded, then the first."""
        with self.lock:
            matched = [self.matched_blocks(r, token_ids) for r in range(len(self.held))]
        return min(range(len(matched)), key=lambda r: (-matched[r], load[r], r))
