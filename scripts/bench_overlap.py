"""How much of a decode step is the host's, measured without a GPU.

    python scripts/bench_overlap.py                       # stand-in device, D = 5 and 0 ms, 64 and 256 sequences
    python scripts/bench_overlap.py --device-ms 5 --seqs 64 --async-scheduling off
    python scripts/bench_overlap.py --num-scheduler-steps 1,8   # one decode step a dispatch, or up to 8
    python scripts/bench_overlap.py --model               # the tiny random Llama itself, not a stand-in

The real engine (the public LLMEngine: scheduler, block manager over a GPU-sized pool of 131,073
blocks of 16, batch building, sampler, outputs, the SmolLM2 tokenizer's incremental detokenizer) on a
2-layer random Llama (hidden 64, vocabulary 8,192), decoding. With a stand-in (the default) the
model call is replaced by one that holds the "device" for D milliseconds without using the host's CPU
(a host callback that sleeps), so what the step costs beyond D is the host's. Per step it reports:

- wall: a decode step's wall time in steady decode (every sequence running, none finishing): the
  timed span over the tokens each sequence took in it (a multi-step dispatch makes several);
- host path: from one model call's end to the next one's dispatch, when positive: the time the
  device waits for the host (0 when the next step was dispatched before this one ended);
- idle: the device's idle share of the wall time (1 - busy / wall);
- gc: the time Python's cyclic garbage collector ran (gc.callbacks), and its full collections: one
  is a pause every few dozen dispatches, which a window of steps catches or not (startup_heap.py).

The sampler is stood in for too (its host inputs are still built, packed and sent, and unpacked on
the device), by a token read off the hidden state: the real lm_head and sampler over 256 rows of
8,192 logits take milliseconds of this CPU's own compute, which a GPU does in microseconds.

With --model the tiny model itself runs (its step is the CPU's real work), and only wall is reported.
"""

import argparse
import ctypes
import dataclasses
import functools
import gc
import itertools
import pathlib
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.loader import load_tokenizer
from models.tiny import TINY_LLAMA, random_model
from paged_jax import EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from paged_jax.core import model_runner, warmup
from paged_jax.core.sampling import SamplerOutput
from paged_jax.core.sampling_params import MAX_LOGPROBS

try:
    from paged_jax.core import packing
except ImportError:  # the engine before asynchronous scheduling
    packing = None
try:
    from paged_jax.core import multi_step
except ImportError:  # the engine before multi-step decode
    multi_step = None

NUM_BLOCKS = 131_073  # a GPU's pool at gpu_memory_utilization 0.9 (docs/gpu.md)
MODEL = dataclasses.replace(TINY_LLAMA, vocab_size=8192, max_position_embeddings=4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-ms", default="5,0", help="the stand-in's time per model call, comma-separated")
    p.add_argument("--seqs", default="64,256", help="running sequences, comma-separated")
    p.add_argument("--steps", type=int, default=60, help="decode steps timed")
    p.add_argument("--async-scheduling", default="on,off", help="on, off, or both (on,off) side by side")
    p.add_argument("--num-scheduler-steps", default="1", help="decode steps per dispatch, comma-separated (1: one)")
    p.add_argument("--model", action="store_true", help="run the tiny model itself, no stand-in")
    return p.parse_args(argv)


@functools.cache
def _stand_in_library() -> ctypes.CDLL:
    """stand_in_device.cc, built once a process and registered as the FFI target "stand_in_hold"."""
    folder = pathlib.Path(tempfile.mkdtemp())
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
                    str(pathlib.Path(__file__).with_name("stand_in_device.cc")), "-o", str(folder / "stand_in.so")],
                   check=True)
    library = ctypes.cdll.LoadLibrary(str(folder / "stand_in.so"))
    jax.ffi.register_ffi_target("stand_in_hold", jax.ffi.pycapsule(library.StandInHold), platform="cpu")
    library.StandInSpans.restype = ctypes.c_int64
    return library


class StandIn:
    """Replaces step_programs.step: holds an XLA thread for `seconds` without using the CPU (an FFI call
    that sleeps, stand_in_device.cc, which needs no GIL), and records when each call was dispatched,
    started and ended. `sample_step` stands in for step_programs.sample_step (patched where the runner looks it up).

    Each stand-in also does ~10^5 flops of real work: XLA's CPU client runs a program it deems cheap
    inline, on the calling thread (waiting there for its inputs), and a model step or a sampler over
    the vocabulary is never cheap; with them they are dispatched as asynchronously as the real ones."""

    def __init__(self, seconds: float):
        self.library = _stand_in_library()
        self._first = self.library.StandInSpans(None, 0)  # the calls of stand-ins made before this one
        self.dispatched: list[float] = []

        # The engine before asynchronous scheduling (351436f) handed its steps the batch and the
        # sampler's rows as pytrees, and its sampler returned the samples alone: the same stand-ins
        # take either, so this script measures both (run it from a checkout of that commit, with
        # --async-scheduling default).
        self._packed = packing is not None
        unpack = lambda packed, layout: packing.unpack(packed, layout) if self._packed else packed

        def work(tree):  # the ~10^5 flops
            return 0 * jnp.sum(jnp.tanh(jax.tree.leaves(tree)[0][:1024].astype(jnp.float32)[:, None] * jnp.arange(64.0)))

        @functools.partial(jax.jit, static_argnames=("graph", "layout"), donate_argnames="kv_cache")
        def call(graph, weights, kv_cache, packed, previous=None, *, layout=None):
            step_input = unpack(packed, layout)
            hold = jax.ffi.ffi_call("stand_in_hold", jax.ShapeDtypeStruct((1,), jnp.int32))
            ids = hold(step_input.input_ids[:1], micros=np.int64(seconds * 1e6), per_step=False)[0]
            # Hidden states that vary with the step's positions, so the sampled tokens do too.
            positions = step_input.positions[step_input.logits_indices].astype(jnp.float32)
            hidden = jnp.sin(positions[:, None] * (1.0 + jnp.arange(MODEL.hidden_size)) + ids + work(packed))
            return hidden.astype(weights[0].dtype), kv_cache

        @functools.partial(jax.jit, static_argnames=("graph", "layout"))
        def sample_step(graph, weights, hidden, packed, previous=None, *, layout=None):
            rows = unpack(packed, layout).temperature.shape[0]
            tokens = (jnp.abs(hidden[:rows, 0].astype(jnp.float32) + work(packed)) * 1e4).astype(jnp.int32)
            tokens %= MODEL.vocab_size
            k = min(MAX_LOGPROBS, MODEL.vocab_size)
            out = SamplerOutput(tokens, jnp.zeros(rows), jnp.zeros((rows, k)), jnp.zeros((rows, k), jnp.int32))
            return (out, jnp.zeros(hidden.shape[0], jnp.int32).at[:rows].set(tokens)) if self._packed else out

        @functools.partial(jax.jit, donate_argnames="kv_cache",
                           static_argnames=("graph", "layout", "attn_backend", "mesh", "max_steps", "block_size",
                                            "eos_ids"))
        def decode_steps(graph, weights, kv_cache, packed, previous, rope_freq, *, layout, max_steps, **_):
            """multi_step.decode_steps' stand-in: holds D for each step the longest row runs."""
            run = packing.unpack(packed, layout)
            rows = run.num_steps.shape[0]
            hold = jax.ffi.ffi_call("stand_in_hold", jax.ShapeDtypeStruct((1,), jnp.int32))
            ids = hold(jnp.max(run.num_steps)[None], micros=np.int64(seconds * 1e6), per_step=True)[0]
            positions = run.step.positions[run.step.logits_indices][:rows] + jnp.arange(max_steps)[:, None]
            tokens = (jnp.abs(jnp.sin(positions.astype(jnp.float32) + ids + work(packed))) * 1e4).astype(jnp.int32)
            tokens %= MODEL.vocab_size
            k = min(MAX_LOGPROBS, MODEL.vocab_size)
            out = SamplerOutput(tokens, jnp.zeros((max_steps, rows)), jnp.zeros((max_steps, rows, k)),
                                jnp.zeros((max_steps, rows, k), jnp.int32))
            last = jnp.take_along_axis(tokens, jnp.maximum(run.num_steps - 1, 0)[None], axis=0)[0]
            return out, previous.at[:rows].set(last), kv_cache

        def dispatch_decode_steps(*args, **keywords):
            self.dispatched.append(time.monotonic())
            return decode_steps(*args, **keywords)

        dispatch_decode_steps._cache_size = lambda: 0  # counted with step's (_cache_size)
        dispatch_decode_steps.lower = decode_steps.lower  # warm-up compiles ahead (parallel_compile)
        self._call, self.sample_step, self._decode_steps = call, sample_step, decode_steps
        self.decode_steps = dispatch_decode_steps

    def _cache_size(self) -> int:  # counted with the runner's programs (ModelRunner.num_compiles)
        return self._call._cache_size() + self.sample_step._cache_size() + self._decode_steps._cache_size()

    def __call__(self, *args, layout=None, **_):
        self.dispatched.append(time.monotonic())
        return self._call(*args, layout=layout)

    def lower(self, *args, layout=None, **_):
        """As step_programs.step.lower: warm-up compiles the model call's programs ahead."""
        return self._call.lower(*args, layout=layout)

    @property
    def spans(self) -> list[tuple[float, float]]:
        """(start, end) of each call that ran, time.monotonic's seconds."""
        count = self.library.StandInSpans(None, 0)
        times = (ctypes.c_int64 * count)()
        self.library.StandInSpans(times, count)
        return [(times[i] / 1e9, times[i + 1] / 1e9) for i in range(self._first, count, 2)]


def make_engine(num_seqs: int, async_scheduling: bool | None, num_scheduler_steps: int = 1) -> LLMEngine:
    options = dict(num_blocks=NUM_BLOCKS, block_size=16, max_num_seqs=num_seqs, max_model_len=2048,
                   max_num_batched_tokens=max(1024, num_seqs * 8), enable_prefix_caching=True)
    if async_scheduling is not None:
        options["async_scheduling"] = async_scheduling
    if num_scheduler_steps != 1:  # an engine before multi-step decode has no such option
        options["num_scheduler_steps"] = num_scheduler_steps
    return LLMEngine(random_model(MODEL), MODEL, load_tokenizer("smollm2-135m"), EngineConfig(**options))


class CollectorClock:
    """The garbage collector's time and full collections while it is entered (gc.callbacks)."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_):
        gc.callbacks.remove(self._callback)


def decode(engine: LLMEngine, num_seqs: int, steps: int) -> tuple[list[float], float, CollectorClock]:
    """Admit num_seqs requests, run until all are decoding, then time `steps` engine steps: each step's
    end, and the tokens a sequence took in them (decode steps: more than `steps` with multi-step decode)."""
    # Streamed as the server streams them (DELTA): each step's new tokens and text.
    most = getattr(engine.resolved, "num_scheduler_steps", 1)
    params = SamplingParams(temperature=0.0, max_tokens=(steps + 8) * most + 64, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(num_seqs):
        engine.add_request([(7 * i + t) % 8000 + 100 for t in range(32)], params)
    while engine.stats().num_waiting_requests or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    read = lambda: sum(len(s.token_ids) for r in engine._requests.values() for s in r.seqs)
    before, ends = read(), [time.monotonic()]
    with CollectorClock() as collector:
        for _ in range(steps):
            engine.step()
            ends.append(time.monotonic())
    tokens = (read() - before) / num_seqs
    for request_id in list(engine._requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return ends, tokens, collector


def measure(num_seqs: int, device_ms: float | None, async_scheduling: bool | None, steps: int,
            num_scheduler_steps: int = 1) -> dict:
    """One engine's figures, per decode step (a token of every sequence): wall and host path are means
    over the timed steps, so a multi-step dispatch's cost is spread over the tokens it makes."""
    stand_in = StandIn(device_ms / 1000) if device_ms is not None else None
    patched = [(model_runner, "step"), (model_runner, "sample_step")]
    if multi_step is not None:
        patched.append((multi_step, "decode_steps"))
    originals = [getattr(module, name) for module, name in patched]
    if stand_in is not None:
        for (module, name), replacement in zip(patched, (stand_in, stand_in.sample_step, stand_in.decode_steps)):
            setattr(module, name, replacement)
    try:
        engine = make_engine(num_seqs, async_scheduling, num_scheduler_steps)
        warmup.warm_up(engine)
        ends, tokens, collector = decode(engine, num_seqs, steps)
        # Its last dispatch done, so that the next stand-in's spans start with its own calls.
        jax.block_until_ready(engine.runner.kv_cache)
    finally:
        for (module, name), original in zip(patched, originals):
            setattr(module, name, original)
    elapsed = ends[-1] - ends[0]
    row = dict(seqs=num_seqs, device_ms=device_ms, overlap=getattr(engine.resolved, "async_scheduling", False),
               steps_per_dispatch=num_scheduler_steps, wall_ms=1e3 * elapsed / tokens,
               gc_ms=1e3 * collector.seconds / tokens, full_gcs=collector.full)
    if stand_in is not None:
        in_window = [(d, s, e) for d, (s, e) in zip(stand_in.dispatched, stand_in.spans) if ends[0] <= s <= ends[-1]]
        gaps = [max(0.0, d2 - e1) for (_, _, e1), (d2, _, _) in zip(in_window, in_window[1:])]
        busy = sum(e - s for _, s, e in in_window)
        row.update(host_path_ms=1e3 * sum(gaps) / tokens, idle=1 - busy / elapsed,
                   wall_over_d=elapsed / tokens / (device_ms / 1e3) if device_ms else None)
    # Every block back in the pool: the prefix cache holds the rest.
    assert engine.blocks.num_free + engine.blocks.num_evictable == engine.blocks.num_blocks - 1
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    modes = {"on": True, "off": False, "default": None}
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; pool {NUM_BLOCKS} blocks of 16; "
          f"{'the tiny model itself' if args.model else 'stand-in device'}")
    for num_seqs in (int(s) for s in args.seqs.split(",")):
        for device_ms in ([None] if args.model else [float(d) for d in args.device_ms.split(",")]):
            for mode, k in itertools.product(args.async_scheduling.split(","),
                                             (int(k) for k in args.num_scheduler_steps.split(","))):
                row = measure(num_seqs, device_ms, modes[mode], args.steps, k)
                figures = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
                print(f"async_scheduling={mode}: {figures}", flush=True)


if __name__ == "__main__":
    main()
