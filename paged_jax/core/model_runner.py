"""Runs one engine step on the device: the jitted model call with sampling fused into it.

The KV cache is donated to every call that changes it, so XLA updates its pages in place, and a step
sends back only what the sampler picked (one device-to-host transfer). `step` is the one jitted step;
`ModelRunner.step_args` gives what the engine passes it, so the same step can be lowered for another
platform (tests lower it for CUDA on a CPU machine).

The methods that touch the device take host arrays only and are `distributed.replicated`: in a group
of processes (many hosts), the leader's call is made on every follower too, each on its own shards.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from kernels_pallas import KVCache, allocate_pages, init_kv_cache
from kernels_pallas.layout import get_pages, set_pages
from models import sharding
from paged_jax.core import distributed, sampling
from paged_jax.core.batch import StepInput, build_step_input
from paged_jax.core.buckets import bucket, pad_to_bucket
from paged_jax.core.config import ResolvedConfig
from paged_jax.core.scheduler import ScheduledSeq


class ModelGraph:
    """The model's structure, a static argument of `step`: its nnx graphdef and the treedef of its
    weights. Hashed once: jit hashes its static arguments on every call, and hashing a graphdef (or
    flattening an nnx.State) walks the whole model in Python, milliseconds a step."""

    def __init__(self, graphdef: nnx.GraphDef, state: nnx.State):
        self.graphdef = graphdef
        self.treedef = jax.tree.structure(state)
        self._hash = hash((graphdef, self.treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, ModelGraph) and self._hash == other._hash
                                 and (self.graphdef, self.treedef) == (other.graphdef, other.treedef))


@functools.partial(jax.jit, static_argnames=("graph", "attn_backend", "mesh"), donate_argnames=("kv_cache",))
def step(graph: ModelGraph, weights: tuple[jax.Array, ...], kv_cache: KVCache, step_input: StepInput,
         sampling_tensors: sampling.SamplingTensors, *, attn_backend: str, mesh: Mesh | None = None):
    """The model over one flat batch, then the sampler on each sequence's last new token.

    weights: the model state's leaves, in graph.treedef's order.
    kv_cache: every layer's pages, donated (updated in place; do not reuse the one passed in).
    attn_backend: a concrete backend (kernels_pallas.BACKENDS, not "auto": the caller knows the
        platform it compiles for, the trace does not).
    mesh: the mesh that state and kv_cache are split over (tensor parallelism), or None.
    Returns (SamplerOutput with S rows, the cache holding the step's K/V).
    """
    model = nnx.merge(graph.graphdef, jax.tree.unflatten(graph.treedef, weights))
    logits, kv_cache = model(step_input.input_ids, step_input.positions, kv_cache, step_input.metadata,
                             step_input.logits_indices, attn_backend=attn_backend, mesh=mesh)
    return sampling.sample(logits, sampling_tensors), kv_cache


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def copy_blocks(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy whole blocks src[i] -> dst[i] in every layer. src, dst: int32 [n]; dst out of range = skip.
    The block axis comes first in every layout, so this copies whole blocks in any."""
    copy = lambda pages: set_pages(pages, dst, get_pages(pages, src))
    return dataclasses.replace(kv_cache, k=tuple(map(copy, kv_cache.k)), v=tuple(map(copy, kv_cache.v)))


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def _write_blocks(kv_cache: KVCache, ids: jax.Array, k: tuple, v: tuple) -> KVCache:
    """ids: int32 [n], out of range = skip; k[l], v[l]: layer l's blocks [n, ...] in the cache's layout
    (as swap_out read them)."""
    put = lambda pages, new: set_pages(pages, ids, new)
    return dataclasses.replace(kv_cache, k=tuple(map(put, kv_cache.k, k)), v=tuple(map(put, kv_cache.v, v)))


class ModelRunner:
    def __init__(self, model, model_config, resolved: ResolvedConfig, mesh: Mesh | None = None):
        """mesh: what the model is split over (tensor parallelism); the KV cache is split over it too."""
        graphdef, self.state = nnx.split(model)
        self.graph = ModelGraph(graphdef, self.state)
        self._weights = tuple(jax.tree.leaves(self.state))
        self.mesh = mesh
        self.model_config = model_config
        self.resolved = resolved
        self.kv_cache = self._new_kv_cache()

    def _new_kv_cache(self) -> KVCache:
        if self.mesh is None:
            # Committed to its device (without a copy), as the step returns it where the weights are
            # committed (memory-mapped ones are): else the first step compiles again on the used cache.
            allocate = lambda shape, dtype: jax.device_put(pages := allocate_pages(shape, dtype), pages.sharding)
        else:
            allocate = functools.partial(jnp.zeros, device=sharding.pages_sharding(self.mesh, self.resolved.kv_layout))
        return init_kv_cache(self.model_config.num_layers, self.resolved.num_blocks, self.resolved.block_size,
                             self.model_config.num_kv_heads, self.model_config.head_dim, jnp.dtype(self.resolved.kv_cache_dtype),
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
        """Programs compiled so far for the step and the block copies (counts recompiles)."""
        return step._cache_size() + copy_blocks._cache_size() + _write_blocks._cache_size()

    def execute(self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]) -> sampling.SamplerOutput:
        """Run the scheduled sequences' new tokens; numpy arrays of what was sampled, one row each."""
        return self.run_step(np.asarray(copies, np.int32).reshape(-1, 2), *self.host_inputs(scheduled))

    def host_inputs(self, scheduled: list[ScheduledSeq]) -> tuple[StepInput, sampling.SamplingTensors]:
        """The step's host arrays for these sequences: the flat batch and page tables, the sampling tensors."""
        step_input = build_step_input(scheduled, self.resolved.block_size)
        seqs = [s.seq for s in scheduled]
        tensors = sampling.make_sampling_tensors(
            [s.params for s in seqs],
            [(s.seed * 31 + s.index) % (2**31 - 1) for s in seqs],
            [s.token_ids[: s.num_prompt_tokens] for s in seqs],
            [s.output_token_ids for s in seqs],
            self.model_config.eos_token_ids,
            pad_rows_to=step_input.logits_indices.shape[0])
        return step_input, tensors

    def step_args(self, scheduled: list[ScheduledSeq]) -> tuple[tuple, dict]:
        """(args, keywords) that `execute` calls `step` with for these sequences: the model's graph, its
        weights, the KV cache, the step's host arrays and sampling tensors; the attention backend."""
        return self._step_args(*self.host_inputs(scheduled))

    def _step_args(self, step_input: StepInput, tensors: sampling.SamplingTensors) -> tuple[tuple, dict]:
        keywords = dict(attn_backend=self.resolved.attention_backend, mesh=self.mesh)
        return (self.graph, self._weights, self.kv_cache, step_input, tensors), keywords

    @distributed.replicated
    def run_step(self, copies: np.ndarray, step_input: StepInput,
                 tensors: sampling.SamplingTensors) -> sampling.SamplerOutput:
        """Copy blocks (copies: int32 [n, 2] rows of src, dst), then run the step; what it sampled, on the host."""
        if len(copies):
            src, dst = copies.T
            self.kv_cache = copy_blocks(self.kv_cache, pad_to_bucket(src, 0),
                                        pad_to_bucket(dst, self.resolved.num_blocks))
        args, keywords = self._step_args(step_input, tensors)
        sampled, self.kv_cache = step(*args, **keywords)
        return distributed.to_host(sampled)

    # Swap preemption: a sequence's blocks go to host memory and come back into fresh blocks.

    def swap_out(self, block_ids: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each layer's K and V blocks [len(block_ids), ...] in the cache's layout, on the host (the
        leader's, whole, in a group)."""
        return self.read_blocks(np.asarray(block_ids, np.int32))

    def swap_in(self, saved: tuple[list[np.ndarray], list[np.ndarray]], block_ids: list[int]) -> None:
        n = len(block_ids)
        size = bucket(n)
        pad = lambda pages: np.concatenate([pages, np.zeros((size - n, *pages.shape[1:]), pages.dtype)])
        k, v = saved
        self.write_blocks(pad_to_bucket(block_ids, self.resolved.num_blocks), tuple(map(pad, k)), tuple(map(pad, v)))

    @distributed.replicated
    def read_blocks(self, ids: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """ids: int32 [n] -> each layer's K and V blocks [n, ...], on the host."""
        return distributed.to_host(([get_pages(k, ids) for k in self.kv_cache.k],
                                    [get_pages(v, ids) for v in self.kv_cache.v]))

    @distributed.replicated
    def write_blocks(self, ids: np.ndarray, k: tuple, v: tuple) -> None:
        """ids: int32 [n], out of range = skip; k[l], v[l]: layer l's blocks [n, ...] (as read_blocks gives them)."""
        self.kv_cache = _write_blocks(self.kv_cache, ids, k, v)
