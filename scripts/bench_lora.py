"""What LoRA adapters cost the engine's model call on SmolLM2, side by side with the same call without them.

    PYTHONPATH=. python scripts/bench_lora.py                   # the engine's CPU matmuls (C++, packed; the
                                                                # slots too: models/lora_packed.py)
    PYTHONPATH=. python scripts/bench_lora.py --matmul xla      # XLA's matmuls (what a GPU runs)

Random adapters of rank --rank on all seven projections, written in PEFT's format, are read and loaded
into --adapters slots of an engine (enable_lora). Timed, alternating the forms, median of --repeats
(--xla-slots adds a third: the same adapters in XLA-layout slots, what the packed ones replace):

- decode: one step of 16 sequences (256 tokens of context each) spread over the adapters, against the
  same step run without LoRA (the model's program without adapters, the engine's enable_lora=False one);
- prefill: one prompt of 512 tokens under one adapter, against the same without;
- adapter load: reading an adapter's folder (safetensors, checks, every layer's tensors stacked and padded
  to the rank: lora.host_slot) and loading it into a slot on the device (one call of lora.load_into,
  compiled before, which moves the stacked arrays over and transposes, scales and casts them there).

The model call is step_programs.step on what the engine's runner gives for these sequences (the head and
sampler are not timed: LoRA does not touch them). Goals (issue 41): decode <= 1.25x, prefill <= 1.15x,
load <= 100 ms. On a machine others load too, the minimum of the repeats is the steadier figure.
"""

import argparse
import dataclasses
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

import jax
import numpy as np
from safetensors.numpy import save_file

from models import load_model, lora
from paged_jax import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from paged_jax.core import step_programs
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.core.sequence import Sequence


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--matmul", default="auto", choices=("auto", "cpu", "xla"))
    p.add_argument("--xla-slots", action="store_true",
                   help="also time the same adapters in XLA-layout slots (where the engine's are packed)")
    return p.parse_args(argv)


def write_adapter(folder: pathlib.Path, config, rank: int, seed: int) -> None:
    """A random adapter on every projection of every layer, as PEFT's save_pretrained writes one."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(config.num_layers):
        for module in lora.TARGETS:
            fan_in, fan_out = lora.module_shape(config, module)
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{i}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = (0.02 * rng.standard_normal((rank, fan_in))).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (0.02 * rng.standard_normal((fan_out, rank))).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(lora.TARGETS), bias="none")))


def sequences(shape: list[tuple[int, int]], slots: list[int], block_size: int) -> list[ScheduledSeq]:
    """(context, new tokens) per sequence, each on its LoRA slot, over consecutive blocks from 1."""
    out, next_block = [], 1
    for i, ((computed, new), slot) in enumerate(zip(shape, slots)):
        total = computed + new
        seq = Sequence(seq_id=i, request_id=str(i), token_ids=[(7 * i + t) % 1000 + 2 for t in range(total)],
                       num_prompt_tokens=total, params=SamplingParams(temperature=0.0), seed=i, arrival_time=0.0)
        seq.block_ids = list(range(next_block, next_block + -(-total // block_size)))
        seq.num_computed_tokens, seq.lora_slot = computed, slot
        next_block += len(seq.block_ids)
        out.append(ScheduledSeq(seq, new))
    return out


def time_steps(engine: LLMEngine, scheduled: list[ScheduledSeq], repeats: int,
               forms: dict[str, lora.LoRAWeights | None]) -> dict[str, list[float]]:
    """Seconds of each model call per form (name -> the slots it runs with, None: without LoRA), alternating."""
    runner = engine.runner
    with_lora = runner.inputs.step(scheduled)[0]
    without = dataclasses.replace(with_lora, lora_rows=None)
    times = {name: [] for name in forms}

    def call(weights) -> float:
        args, keywords = runner._step_args(without if weights is None else with_lora)
        args = args[:5] if weights is None else (*args[:5], weights)
        start = time.perf_counter()
        hidden, runner.kv_cache = step_programs.step(*args, **keywords)
        hidden.block_until_ready()
        return time.perf_counter() - start

    for weights in forms.values():  # compile, and a first run
        call(weights)
    for _ in range(repeats):
        for name, weights in forms.items():
            times[name].append(call(weights))
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    cpu = subprocess.run("lscpu | grep -E 'Model name'", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"device: {jax.devices()[0].device_kind}; {cpu}; the machine may be shared with others' work")
    loaded = load_model(args.model)
    engine = LLMEngine(loaded.model, loaded.config, loaded.tokenizer, EngineConfig(
        enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, max_num_seqs=16,
        max_num_batched_tokens=512, num_blocks=160, matmul_backend=args.matmul))
    print(f"matmul: {engine.resolved.matmul_backend}; attention: {engine.resolved.attention_backend}; "
          f"{args.adapters} slots of rank {args.rank}")
    adapters = engine.adapters
    adapters.warm_up()
    reads, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        requests = []
        for i in range(args.adapters):
            folder = pathlib.Path(tmp) / f"adapter{i}"
            write_adapter(folder, loaded.config, args.rank, i)
            requests.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
        for _ in range(max(1, args.repeats // args.adapters)):
            for request in requests:
                adapters.remove(request.lora_int_id)  # as if never read: its host copy and its slot go
                start = time.perf_counter()
                adapters.check(request)
                reads.append(time.perf_counter() - start)
                start = time.perf_counter()
                adapters.acquire(request, [])
                jax.block_until_ready(adapters.weights)
                loads.append(time.perf_counter() - start)
        forms = {"without LoRA": None, "with": adapters.weights}
        if args.xla_slots:  # the same adapters in the same slots, in XLA's layout (models/lora.py)
            forms["XLA-layout slots"] = lora.empty(loaded.config, args.adapters, args.rank)
            for request in requests:
                forms["XLA-layout slots"] = lora.load_into(forms["XLA-layout slots"], np.int32(
                    adapters.acquire(request, [])), adapters.read(request))
    totals = [r + l for r, l in zip(reads, loads)]
    for stat in (statistics.median, min):
        print(f"adapter load, {stat.__name__} of {len(totals)}: {1e3 * stat(totals):.1f} ms (read "
              f"{1e3 * stat(reads):.1f} ms, into a slot {1e3 * stat(loads):.1f} ms); goal: 100 ms in all")
    block = engine.resolved.block_size
    cases = {
        f"decode, 16 rows over {args.adapters} adapters": (
            sequences([(255, 1)] * 16, [i % args.adapters + 1 for i in range(16)], block), 1.25),
        "prefill, 512 tokens, one adapter": (sequences([(0, 512)], [1], block), 1.15),
    }
    for name, (scheduled, goal) in cases.items():
        times = time_steps(engine, scheduled, args.repeats, forms)
        for stat in (statistics.median, min):
            base = stat(times["without LoRA"])
            others = ", ".join(f"{1e3 * stat(t):.1f} ms {form}: {stat(t) / base:.3f}x"
                               for form, t in times.items() if form != "without LoRA")
            print(f"{name}, {stat.__name__} of {args.repeats}: {1e3 * base:.1f} ms without LoRA, {others} "
                  f"(goal <= {goal}x)")


if __name__ == "__main__":
    main()
