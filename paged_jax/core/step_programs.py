"""The two jitted programs of an engine step: the model over the step's flat batch (`step`), then the
final norm, the lm_head and the sampler over the rows that sample (`sample_step`).

Two programs, so that their static sizes multiply no further than each needs (buckets.py): the model's
by the step's tokens, the head's and sampler's by the sampled rows, which the lm_head pays for one by
one. Both take the model as a static `ModelGraph` and its weights as leaves, so that the same call can
be lowered for another platform (tests lower it for CUDA on a CPU machine); the KV cache is donated.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from kernels_pallas import KVCache
from paged_jax.core import packing, sampling, sampling_tensors
from paged_jax.core.batch import StepInput


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


@functools.partial(jax.jit, static_argnames=("graph", "layout", "attn_backend", "mesh"), donate_argnames=("kv_cache",))
def step(graph: ModelGraph, weights: tuple[jax.Array, ...], kv_cache: KVCache, packed: jax.Array,
         previous: jax.Array, lora=None, *, layout: packing.Layout, attn_backend: str, mesh: Mesh | None = None):
    """The model's layers over one flat batch.

    weights: the model state's leaves, in graph.treedef's order.
    kv_cache: every layer's pages, donated (updated in place; do not reuse the one passed in).
    packed: int32 [words], the step's StepInput as packing.pack laid it out (layout): one transfer.
    previous: int32 [num_head_rows], the previous step's sampled tokens, which the batch's
        placeholders (step_input.token_src) take their ids from.
    attn_backend: a concrete backend (kernels_pallas.BACKENDS, not "auto": the caller knows the
        platform it compiles for, the trace does not).
    mesh: the mesh that state and kv_cache are split over (tensor parallelism), or None.
    lora: the LoRA adapters' slots (models.lora.LoRAWeights), which step_input.lora_rows index; None: none.
    Returns (the last layer's output at step_input.logits_indices [num_head_rows, hidden], the cache
    holding the step's K/V).
    """
    model = nnx.merge(graph.graphdef, jax.tree.unflatten(graph.treedef, weights))
    step_input: StepInput = packing.unpack(packed, layout)
    src = step_input.token_src
    input_ids = jnp.where(src >= 0, previous[jnp.maximum(src, 0)], step_input.input_ids)
    hidden, kv_cache = model.hidden_states(input_ids, step_input.positions, kv_cache, step_input.metadata,
                                           attn_backend=attn_backend, mesh=mesh,
                                           cos_sin=(step_input.cos, step_input.sin), lora=lora,
                                           lora_rows=step_input.lora_rows)
    return hidden[step_input.logits_indices], kv_cache


@functools.partial(jax.jit, static_argnames=("graph", "layout"))
def sample_step(graph: ModelGraph, weights: tuple[jax.Array, ...], hidden: jax.Array, packed: jax.Array,
                previous: jax.Array, *, layout: packing.Layout) -> tuple[sampling.SamplerOutput, jax.Array]:
    """The final norm, the lm_head and the sampler over the first S rows of hidden [rows, hidden] (S:
    the tensors' rows); packed: int32 [words], the SamplingTensors as packing.pack laid them out;
    previous: int32 [rows], the previous step's tokens (a history's PENDING ids).
    Returns the SamplerOutput with S rows, and its tokens padded to int32 [rows] for the next step."""
    model = nnx.merge(graph.graphdef, jax.tree.unflatten(graph.treedef, weights))
    tensors: sampling_tensors.SamplingTensors = packing.unpack(packed, layout)
    sampled = sampling.sample_head(model, hidden[: tensors.temperature.shape[0]], tensors, previous)
    return sampled, jnp.zeros(hidden.shape[0], jnp.int32).at[: sampled.tokens.shape[0]].set(sampled.tokens)
