"""The head and the rejection sampler over a verify step's rows: sample_step's counterpart
(model_runner.py) for a step with drafts."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.core import packing
from paged_jax.spec_decode.rejection import rejection_sample


@functools.partial(jax.jit, static_argnames=("graph", "layout"))
def verify_step(graph, weights: tuple[jax.Array, ...], hidden: jax.Array, packed: jax.Array, previous: jax.Array,
                *, layout: packing.Layout):
    """The final norm, the lm_head and the rejection sampler over the first S rows of hidden [rows,
    hidden]; packed: int32 [words], (SamplingTensors, drafts int32 [S]) as packing.pack laid them out;
    graph, weights, previous as in step_programs.sample_step.
    Returns ((SamplerOutput, accepted bool [S]), its tokens padded to int32 [rows] for the next step)."""
    model = nnx.merge(graph.graphdef, jax.tree.unflatten(graph.treedef, weights))
    tensors, drafts = packing.unpack(packed, layout)
    logits = model.logits(hidden[: drafts.shape[0]], tensors.num_rows)
    sampled, accepted = rejection_sample(logits, tensors, drafts, previous)
    padded = jnp.zeros(hidden.shape[0], jnp.int32).at[: sampled.tokens.shape[0]].set(sampled.tokens)
    return (sampled, accepted), padded
