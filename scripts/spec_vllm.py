"""vLLM's CPU build beside bench_spec.py's systems: its offline LLM without speculation ("vllm") and with
its n-gram proposer ("vllm-ngram": speculative_config {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4}), each a peer_driver.py process kept warm (bench_peers.Peer).

vLLM's offline LLM takes all its requests at once, so concurrency c is emulated by runs of c requests
in turn (a batch, not a closed loop). Where vLLM refuses speculation, its error message is printed
verbatim and the run goes on with plain vLLM only.
"""

import argparse
import json
import sys

import bench_peers


class Peer:
    def __init__(self, args, workloads: list[list[tuple[list[int], int]]]):
        """workloads: the requests (prompt ids, max_tokens) of every cell vLLM runs; its warm-up runs them once."""
        folder = bench_peers.hf_folder(args.model)
        longest = max(len(p) + m for requests in workloads for p, m in requests)
        options = argparse.Namespace(hf_batch_size=16)
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
        self.peers = {"vllm": bench_peers.Peer("vllm", args.vllm_python, folder, options, max(1024, longest))}
        self.refusal = None
        try:
            self.peers["vllm-ngram"] = bench_peers.Peer("vllm", args.vllm_python, folder, options, max(1024, longest),
                                                        ["--speculative-config", json.dumps(spec)])
        except RuntimeError as error:
            self.refusal = str(error)
            print(f"vLLM refused speculative_config={spec}: {self.refusal}", file=sys.stderr, flush=True)
        for requests in workloads:
            self.round(requests, len(requests))  # vLLM's first runs compile and capture, untimed

    def round(self, requests: list[tuple[list[int], int]], concurrency: int):
        """[(system name, output tokens/s, outputs)] of one run of the requests per vLLM system."""
        body = [{"prompt_token_ids": p, "max_new_tokens": m} for p, m in requests]
        out = []
        for name, peer in self.peers.items():
            wall, tokens = 0.0, []
            for start in range(0, len(body), concurrency):
                answer = peer.run(body[start : start + concurrency])
                wall += answer["wall_s"]
                tokens += answer["token_ids"]
            out.append((name, sum(map(len, tokens)) / wall, tokens))
        return out

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()

