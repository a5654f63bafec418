"""Runs one engine step on the device: the model call over the step's flat batch, then the head and
the sampler over the rows that sample (step_programs.py), on host arrays built by step_inputs.py.
Every program a step can run is made by `warm_up`, on padding that writes nothing.

The KV cache is donated to every call that changes it, so XLA updates its pages in place, and a step
sends back only what the sampler picked (one device-to-host transfer). A step is dispatched
(`dispatch`) and its samples read (`collect`) apart, so the engine can dispatch the next step before
it reads this one's (asynchronous scheduling, engine.py): the sampled tokens also stay on the device,
padded to a fixed width, where the next step's placeholders read them (batch.py). `ModelRunner.step_args` gives
what the engine passes the model call, so the same call can be lowered for another platform (tests
lower it for CUDA on a CPU machine).

The methods that touch the device take host arrays only and are `distributed.replicated`: in a group
of processes (many hosts), the leader's call is made on every follower too, each on its own shards.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kernels_pallas import KVCache, allocate_pages, init_kv_cache
from models import sharding
from paged_jax.core import distributed, kv_blocks, multi_step, packing, parallel_compile, sampling, sampling_tensors
from paged_jax.core.batch import StepInput
from paged_jax.core.buckets import pad_ids
from paged_jax.core.resolve import ResolvedConfig
from paged_jax.core.sampling_params import SamplingParams
from paged_jax.core.scheduler_output import ScheduledSeq
from paged_jax.core.step_inputs import StepInputs
from paged_jax.core.step_programs import ModelGraph, sample_step, step
from paged_jax.spec_decode.verify_step import verify_step

# Blocks per swap transfer: a sequence's blocks move in several calls of this one shape.
SWAP_BLOCKS = 16


class ModelRunner:
    def __init__(self, model, model_config, resolved: ResolvedConfig, mesh: Mesh | None = None,
                 max_decode_steps: int = 1, adapters=None):
        """mesh: what the model is split over (tensor parallelism); the KV cache is split over it too.
        max_decode_steps: the most decode steps one dispatch may run (multi_step.py); 1: none does more.
        adapters: the engine's adapters.AdapterSlots with LoRA enabled, else None (multi-step decode
        runs without: the engine refuses both)."""
        self.adapters = adapters
        graphdef, self.state = nnx.split(model)
        self.graph = ModelGraph(graphdef, self.state)
        self._weights = tuple(jax.tree.leaves(self.state))
        self.mesh = mesh
        self.model_config = model_config
        self.resolved = resolved
        self.inputs = StepInputs(resolved, model_config, adapters)
        self.kv_cache = self._new_kv_cache()
        # The last dispatched step's sampled tokens, on the device: the next step's placeholders' ids.
        replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
                      else self._weights[0].sharding)
        self._previous = jax.device_put(np.zeros(resolved.buckets.num_head_rows, np.int32), replicated)
        self.max_decode_steps = max_decode_steps
        self._rope_freq_device = jax.device_put(self.inputs.rope_freq, replicated)
        self.step_observers: list = []  # each called with a step's scheduled sequences before it runs (step_profile.py)
        self.device_seconds = 0.0  # dispatching steps and waiting for their samples, so far
        self.speculative = False  # whether steps may verify drafts (spec_decode/): warm_up makes verify_step too

    def _new_kv_cache(self) -> KVCache:
        if self.mesh is None:
            # Committed to its device (without a copy), as the step returns it where the weights are
            # committed (memory-mapped ones are): else the first step compiles again on the used cache.
            allocate = lambda shape, dtype: jax.device_put(pages := allocate_pages(shape, dtype), pages.sharding)
        else:
            allocate = functools.partial(jnp.zeros, device=sharding.pages_sharding(self.mesh, self.resolved.kv_layout))
        return init_kv_cache(self.resolved.kv_groups.num_arrays, self.resolved.num_blocks, self.resolved.block_size,
                             self.model_config.num_kv_heads, self.model_config.head_dim,
                             jnp.dtype(self.resolved.kv_cache_dtype),
                             layout=self.resolved.kv_layout, allocate=allocate)

    def restore_kv_cache(self) -> bool:
        """After a failed call: whether the failure took the KV cache, and if so a fresh one in its place.
        XLA frees donated buffers even when the call fails at run time."""
        if not any(pages.is_deleted() for pages in jax.tree.leaves(self.kv_cache)):
            return False
        self.kv_cache = self._new_kv_cache()
        return True

    @property
    def num_compiles(self) -> int:
        """Programs of the step's calls (model, sampler, block copies, swaps) compiled or loaded so far,
        for any runner of this process (counts recompiles). compiles.count() counts every program."""
        return sum(f._cache_size() for f in (step, sample_step, verify_step, multi_step.decode_steps,
                                             kv_blocks.copy_blocks, kv_blocks.read_blocks, kv_blocks.write_blocks))

    def execute(self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]) -> sampling.SamplerOutput:
        """Run the scheduled sequences' new tokens; numpy arrays of what was sampled, one row each."""
        return self.collect(self.dispatch(scheduled, copies))

    def dispatch(self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]],
                 num_steps: list[int] | None = None, verify_inputs: tuple | None = None) -> sampling.SamplerOutput:
        """Start the step (block copies, the model call, the sampler) and return at once: its samples,
        device arrays on their way to the host, for `collect`. A scheduled sequence with a pending token
        reads it from the previously dispatched step's samples (seq.sample_row).

        num_steps: decode steps each sequence runs in this dispatch (multi_step.py; every sequence
        decodes, and no block is copied); the samples then have a leading axis of max_decode_steps.
        verify_inputs: a step with drafts, its (StepInput, SamplingTensors, drafts) from
        Speculator.verify_inputs; its samples are then (SamplerOutput, accepted), rejection.py's."""
        for observe in self.step_observers:
            observe(scheduled)
        start = time.perf_counter()
        if num_steps is None:
            sampled = self.dispatch_step(np.asarray(copies, np.int32).reshape(-1, 2),
                                         *(verify_inputs or self.inputs.step(scheduled)))
        else:
            sampled = self.dispatch_decode(self.inputs.decode_run(scheduled, num_steps))
        for x in jax.tree.leaves(sampled):
            x.copy_to_host_async()
        self.device_seconds += time.perf_counter() - start
        return sampled

    def collect(self, sampled: sampling.SamplerOutput) -> sampling.SamplerOutput:
        """A dispatched step's samples on the host (numpy), once the step is done."""
        start = time.perf_counter()
        sampled = distributed.to_host(sampled)
        self.device_seconds += time.perf_counter() - start
        return sampled

    def step_args(self, scheduled: list[ScheduledSeq]) -> tuple[tuple, dict]:
        """(args, keywords) that `execute` calls `step`, the model call, with for these sequences: the
        model's graph, its weights, the KV cache, the step's host arrays; the attention backend."""
        return self._step_args(self.inputs.step(scheduled)[0])

    def _step_args(self, step_input: StepInput) -> tuple[tuple, dict]:
        packed, layout = packing.pack(step_input)
        keywords = dict(layout=layout, attn_backend=self.resolved.attention_backend, mesh=self.mesh)
        lora = () if self.adapters is None else (self.adapters.weights,)
        return (self.graph, self._weights, self.kv_cache, packed, self._previous, *lora), keywords

    def sample_args(self, hidden: jax.Array, tensors: sampling_tensors.SamplingTensors) -> tuple[tuple, dict]:
        """(args, keywords) that `sample_step` is called with for the model call's output and these tensors."""
        packed, layout = packing.pack(tensors)
        return (self.graph, self._weights, hidden, packed, self._previous), dict(layout=layout)

    def _sample(self, hidden: jax.Array, tensors: sampling_tensors.SamplingTensors):
        args, keywords = self.sample_args(hidden, tensors)
        return sample_step(*args, **keywords)

    def _verify(self, hidden: jax.Array, tensors: sampling_tensors.SamplingTensors, drafts: np.ndarray):
        """drafts: int32 [S], each row's draft or -1 (spec_decode/verify_step.py)."""
        packed, layout = packing.pack((tensors, drafts))
        return verify_step(self.graph, self._weights, hidden, packed, self._previous, layout=layout)

    @distributed.replicated
    def dispatch_step(self, copies: np.ndarray, step_input: StepInput, tensors: sampling_tensors.SamplingTensors,
                      drafts: np.ndarray | None = None) -> sampling.SamplerOutput:
        """Copy blocks (copies: int32 [n, 2] rows of src, dst), then run the step and its sampler; what
        it sampled, device arrays. Each process keeps its own copy of the sampled tokens for the next
        step's placeholders, so a group's messages carry host arrays only."""
        width = self.resolved.buckets.num_head_rows  # a step makes at most one copy per sequence
        for i in range(0, len(copies), width):
            chunk = copies[i : i + width]
            self.kv_cache = kv_blocks.copy_blocks(self.kv_cache, np.pad(chunk, ((0, width - len(chunk)), (0, 0))),
                                        np.int32(len(chunk)))
        args, keywords = self._step_args(step_input)
        hidden, self.kv_cache = step(*args, **keywords)
        sampled, self._previous = self._sample(hidden, tensors) if drafts is None else self._verify(hidden, tensors, drafts)
        return sampled

    def decode_args(self, run: multi_step.DecodeRun) -> tuple[tuple, dict]:
        """(args, keywords) that `dispatch_decode` calls multi_step.decode_steps with for `run`."""
        packed, layout = packing.pack(run)
        keywords = dict(layout=layout, attn_backend=self.resolved.attention_backend, mesh=self.mesh,
                        max_steps=self.max_decode_steps, block_size=self.resolved.block_size,
                        eos_ids=tuple(self.model_config.eos_token_ids))
        return (self.graph, self._weights, self.kv_cache, packed, self._previous, self._rope_freq_device), keywords

    @distributed.replicated
    def dispatch_decode(self, run: multi_step.DecodeRun) -> sampling.SamplerOutput:
        """Run up to max_decode_steps decode steps (multi_step.py); what they sampled, device arrays."""
        args, keywords = self.decode_args(run)
        sampled, self._previous, self.kv_cache = multi_step.decode_steps(*args, **keywords)
        return sampled

    def warm_up(self) -> None:
        """Make every program a step can run (buckets.py): each model-call shape, each sampler row count
        with and without penalties, greedy and drawing at random, a block copy and a swap each way, all
        on padding: no token is written, the only block copied is the null block onto itself,
        swapped-in blocks land nowhere. First every page of the KV cache is written once (kv_blocks.write_every_page)."""
        if self.mesh is None and self.resolved.platform == "cpu":  # the one pool allocated unwritten (_new_kv_cache)
            self.kv_cache = kv_blocks.write_every_page(self.kv_cache)
        buckets = self.resolved.buckets
        samplers = [self.inputs.sampling([params] * rows, [0] * rows, [[0]] * rows, [[]] * rows)
                    for rows in buckets.all_sample_rows()
                    for params in (SamplingParams(temperature=0), SamplingParams(),
                                   SamplingParams(temperature=0, repetition_penalty=1.1),
                                   SamplingParams(repetition_penalty=1.1))]
        forms = [self.inputs.padding(shape) for shape in buckets.shapes()]
        runs = self._warm_decode_runs() if self.max_decode_steps > 1 else []
        # The costly programs compiled side by side first; the calls below then find them made. The
        # samplers' input is a model call's output, shaped and placed as the first program says.
        compiled = parallel_compile.compile_all(
            [step.lower(*a, **k) for a, k in map(self._step_args, sum(forms, []))]
            + [multi_step.decode_steps.lower(*a, **k) for a, k in map(self.decode_args, runs)])
        hidden = jax.device_put(np.zeros(compiled[0].out_info[0].shape, compiled[0].out_info[0].dtype),
                                compiled[0].output_shardings[0])
        parallel_compile.compile_all([sample_step.lower(*a, **k)
                                      for a, k in (self.sample_args(hidden, t) for t in samplers)])
        for i, step_inputs in enumerate(forms):
            for j, step_input in enumerate(step_inputs):
                self.warm_step(step_input, samplers if i == j == 0 else [])
        # The step's previous tokens are a sample_step output from here on; warm_step ran on the first
        # ones (_previous), placed where those outputs are, so no program is made twice.
        self.collect(self.dispatch_step(np.zeros((1, 2), np.int32), self.inputs.padding(buckets.shapes()[0])[0],
                                        samplers[0]))
        for run in runs:
            self.collect(self.dispatch_decode(run))
        self.swap_in(self.swap_out([0]), [self.resolved.num_blocks])
        if self.adapters is not None:
            self.adapters.warm_up()

    def _warm_decode_runs(self) -> list[multi_step.DecodeRun]:
        """A run of every multi-step program: a decode step's shape and sampler rows for each number of
        rows, greedy and drawing at random (penalties never run several steps), on padding rows that run none."""
        buckets = self.resolved.buckets
        pairs = dict.fromkeys((buckets.shape(rows, 1), buckets.sample_rows(rows))
                              for rows in range(1, buckets.num_head_rows + 1))
        runs = []
        for shape, rows in pairs:
            for params in (SamplingParams(temperature=0), SamplingParams()):
                tensors = self.inputs.sampling([params] * rows, [0] * rows, [[0]] * rows, [[]] * rows)
                runs.append(self.inputs.padded_decode_run(self.inputs.padding(shape)[0], tensors, [0] * rows,
                                                          [False] * rows))
        return runs

    @distributed.replicated
    def warm_step(self, step_input: StepInput, samplers: list[sampling_tensors.SamplingTensors]) -> None:
        """Run the model call on step_input, then the sampler with each of samplers on its output."""
        args, keywords = self._step_args(step_input)
        hidden, self.kv_cache = step(*args, **keywords)
        jax.block_until_ready([self._sample(hidden, tensors) for tensors in samplers])
        if self.speculative:
            jax.block_until_ready([self._verify(hidden, t, np.full(t.temperature.shape[0], -1, np.int32))
                                   for t in samplers])

    # Swap preemption: a sequence's blocks go to host memory and come back into fresh blocks, a fixed
    # number of blocks per call.

    def swap_out(self, block_ids: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's K and V blocks [len(block_ids), ...] in the cache's layout, on the host (the
        leader's, whole, in a group)."""
        chunks = [self.read_blocks(pad_ids(block_ids[i : i + SWAP_BLOCKS], SWAP_BLOCKS, 0))
                  for i in range(0, len(block_ids), SWAP_BLOCKS)]
        n = len(block_ids)
        join = lambda layers: [np.concatenate(pages)[:n] for pages in zip(*layers)]
        return join([k for k, _ in chunks]), join([v for _, v in chunks])

    def swap_in(self, saved: tuple[list[np.ndarray], list[np.ndarray]], block_ids: list[int]) -> None:
        k, v = saved
        for i in range(0, len(block_ids), SWAP_BLOCKS):
            ids = block_ids[i : i + SWAP_BLOCKS]
            pad = lambda pages: np.concatenate([pages[i : i + len(ids)],
                                                np.zeros((SWAP_BLOCKS - len(ids), *pages.shape[1:]), pages.dtype)])
            self.write_blocks(pad_ids(ids, SWAP_BLOCKS, self.resolved.num_blocks), tuple(map(pad, k)),
                              tuple(map(pad, v)))

    @distributed.replicated
    def read_blocks(self, ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """ids: int32 [SWAP_BLOCKS] -> each layer's K and V blocks [SWAP_BLOCKS, ...], on the host."""
        return distributed.to_host(kv_blocks.read_blocks(self.kv_cache, ids))

    @distributed.replicated
    def write_blocks(self, ids: np.ndarray, k: tuple, v: tuple) -> None:
        """ids: int32 [SWAP_BLOCKS], out of range = skip; k[l], v[l]: layer l's blocks [SWAP_BLOCKS, ...]
        (as read_blocks gives them)."""
        self.kv_cache = kv_blocks.write_blocks(self.kv_cache, ids, k, v)
