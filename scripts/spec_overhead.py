"""What speculation costs while it is off by batch size: engines with and without it, stepped in turn
on the same 16 decoding sequences, timed per step (host and device apart) and per Speculator call.

    python scripts/spec_overhead.py [--steps 60] [--methods ngram,suffix] [--max-num-seqs 16]

Each engine gets W1's first max_num_seqs prompts (greedy, EOS ignored, long enough not to finish),
is stepped until every sequence decodes (disable_by_batch_size, 6 by default, is then passed, so the
speculating engines draft nothing), and then the engines step in turn, --steps times each. Printed
per engine: the median step, its device part (ModelRunner.device_seconds: dispatch and collect) and
host part (the rest: scheduling, inputs, outputs), the median over steps of none's step over the
engine's, and the Speculator's own time per step (propose, fit; all speculating engines together).
The head's rows differ (max_num_seqs x (k + 1) with speculation, to give verify steps a compiled
shape): the model call gathers that many rows of its output, while the lm_head and sampler run on
the same rows as none's.
"""

import argparse
import statistics
import time

import numpy as np
import spec_workloads

import models
from paged_jax import EngineConfig, LLMEngine, SamplingParams
from paged_jax.spec_decode.speculator import Speculator


def timed(spent: dict[str, float], name: str):
    """Speculator.<name> wrapped to add its seconds to spent[name]."""
    method = getattr(Speculator, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

    return wrapper


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--methods", default="ngram,suffix")
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args(argv)
    loaded = models.load_model(args.model)
    spent: dict[str, float] = {}
    for name in ("propose", "fit"):
        setattr(Speculator, name, timed(spent, name))
    engines = {}
    for name in ["none", *args.methods.split(",")]:
        engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=1024, kv_cache_memory_bytes=1 << 30,
            speculative_config=None if name == "none" else {"method": name}))
        for prompt, _ in spec_workloads.w1(args.max_num_seqs, 1):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2 * args.steps + 100, ignore_eos=True))
        running = engine.scheduler.running
        while len(running) < args.max_num_seqs or any(s.num_computed_tokens < len(s.token_ids) - 1 for s in running):
            engine.step()
        for _ in range(3):  # the decode shapes compiled
            engine.step()
        engines[name] = engine
    spent.clear()
    times = {name: [] for name in engines}
    device = {name: [] for name in engines}
    for _ in range(args.steps):
        for name, engine in engines.items():
            before, start = engine.runner.device_seconds, time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
            device[name].append(engine.runner.device_seconds - before)
    results = {}
    for name in engines:
        r = results[name] = {"step_ms": statistics.median(times[name]) * 1e3,
                             "device_ms": statistics.median(device[name]) * 1e3,
                             "host_ms": statistics.median(np.subtract(times[name], device[name])) * 1e3,
                             "none_over_this": statistics.median(np.divide(times["none"], times[name]))}
        print(f"{name:7s} step {r['step_ms']:7.2f} ms  device {r['device_ms']:7.2f} ms  host {r['host_ms']:6.3f} ms  "
              f"none/this {r['none_over_this']:.3f}")
    results["speculator_us_per_step"] = {k: v / args.steps * 1e6 for k, v in spent.items()}
    print("Speculator time a step, the speculating engines together:",
          "  ".join(f"{k} {v:.1f} us" for k, v in results["speculator_us_per_step"].items()))
    return results


if __name__ == "__main__":
    main()
