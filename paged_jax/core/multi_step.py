"""Multi-step decode: several decode steps in one dispatch, each step's samples fed to the next on the
device, so the host schedules, builds and reads once for K tokens a sequence.

The engine uses it (EngineConfig.num_scheduler_steps, vLLM's name) when every running sequence
decodes and nothing between two steps needs the host: no grammar mask, beam, penalty history or
min_tokens ban changes from one token to the next, and no prompt waits to be admitted. Each row runs
its own number of steps (`DecodeRun.num_steps`: at most K, and no further than its max_tokens or the
context allow), for which the scheduler has reserved its blocks; past them a row writes no KV. A row
that samples an end-of-sequence id stops there on the device too, and the loop ends once every row
has, so a batch that finishes early does not run out its K steps. Stop strings and stop token ids are
the host's: the tokens a row sampled after one are read and dropped, never emitted (engine.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models import rope
from paged_jax.core import packing, sampling, sampling_tensors
from paged_jax.core.batch import StepInput
from paged_jax.core.sequence import Sequence


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """A multi-step dispatch's host inputs, packed as one buffer (packing.py)."""

    step: StepInput  # the first step: one new token a row, row i's at flat position i
    tensors: sampling_tensors.SamplingTensors  # S rows; their `steps` advance by one each step
    num_steps: jax.Array  # int32 [S] steps row i runs (1..K; 0 for padding rows)
    stops_at_eos: jax.Array  # bool [S] whether an end-of-sequence id ends row i (not ignore_eos)


@functools.partial(jax.jit, donate_argnames=("kv_cache",),
                   static_argnames=("graph", "layout", "attn_backend", "mesh", "max_steps", "block_size", "eos_ids"))
def decode_steps(graph, weights: tuple[jax.Array, ...], kv_cache, packed: jax.Array, previous: jax.Array,
                 rope_freq: jax.Array, *, layout: packing.Layout, attn_backend: str, mesh: Mesh | None,
                 max_steps: int, block_size: int, eos_ids: tuple[int, ...]):
    """Up to max_steps decode steps of the model and its sampler (step_programs.step and sample_step, fused).

    weights, kv_cache (donated), attn_backend, mesh: as step_programs.step takes them.
    packed: int32 [words], a DecodeRun as packing.pack laid it out (layout).
    previous: int32 [num_head_rows], the previous dispatch's last samples (the first step's placeholders').
    rope_freq: float32 [F], rope.inv_freq of the model.
    Returns (a SamplerOutput whose arrays have a leading axis of max_steps, step j's samples at j;
    each row's last sample padded to int32 [num_head_rows], for the next dispatch; the KV cache).
    """
    model = nnx.merge(graph.graphdef, jax.tree.unflatten(graph.treedef, weights))
    run: DecodeRun = packing.unpack(packed, layout)
    first = run.step
    # One AttentionMetadata, or one per KV group (group_tables.py): each group has its page table.
    grouped = isinstance(first.metadata, tuple)
    metas = first.metadata if grouped else (first.metadata,)
    meta = metas[0]
    rows, num_tokens, num_att = run.num_steps.shape[0], first.input_ids.shape[0], meta.seq_lens.shape[0]
    # Row i's one token is flat token i, and attention row i: per-token and per-attention-row views.
    token_steps = jnp.zeros(num_tokens, jnp.int32).at[:rows].set(run.num_steps)
    att_steps = token_steps[:num_att]
    tables = [m.block_tables[jnp.minimum(jnp.arange(num_tokens), num_att - 1)] for m in metas]
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    ids = jnp.where(first.token_src >= 0, previous[jnp.maximum(first.token_src, 0)], first.input_ids)
    blank = jax.eval_shape(sampling.sample, jax.ShapeDtypeStruct((rows, model.config.vocab_size), jnp.float32),
                           run.tensors)
    outputs = jax.tree.map(lambda x: jnp.zeros((max_steps, *x.shape), x.dtype), blank)

    def body(carry):
        j, kv_cache, ids, last, stopped, outputs = carry
        positions = first.positions + j
        writes = j < token_steps
        seq_lens = meta.seq_lens + jnp.clip(j, 0, jnp.maximum(att_steps - 1, 0))
        slots = [t[jnp.arange(num_tokens), positions // block_size] * block_size + positions % block_size for t in tables]
        metadata = tuple(dataclasses.replace(m, slot_mapping=jnp.where(writes, s, -1), seq_lens=seq_lens)
                         for m, s in zip(metas, slots))
        hidden, kv_cache = model.hidden_states(ids, positions, kv_cache, metadata if grouped else metadata[0],
                                               attn_backend=attn_backend, mesh=mesh,
                                               cos_sin=rope.cos_sin(positions, rope_freq))
        tensors = dataclasses.replace(run.tensors, steps=run.tensors.steps + j)
        sampled = sampling.sample_head(model, hidden[first.logits_indices][:rows], tensors)
        alive = (j < run.num_steps) & ~stopped
        last = jnp.where(alive, sampled.tokens, last)
        stopped |= alive & run.stops_at_eos & jnp.isin(sampled.tokens, eos)
        outputs = jax.tree.map(lambda out, x: out.at[j].set(x), outputs, sampled)
        ids = jnp.zeros(num_tokens, jnp.int32).at[:rows].set(sampled.tokens)
        return j + 1, kv_cache, ids, last, stopped, outputs

    def more(carry):
        j, *_, stopped, _ = carry
        return (j < max_steps) & jnp.any((j < run.num_steps) & ~stopped)

    start = (jnp.int32(0), kv_cache, ids, previous[:rows], jnp.zeros(rows, bool), outputs)
    _, kv_cache, _, last, _, outputs = jax.lax.while_loop(more, body, start)
    return outputs, previous.at[:rows].set(last), kv_cache


def num_steps(running: list[Sequence], may_admit: bool, most: int) -> int:
    """Decode steps the next dispatch may run: `most` (num_scheduler_steps) while every running sequence
    decodes and no prompt could be admitted (may_admit), and no token changes what the next one's sampler
    is given (a grammar's mask, beams, a penalty's history, a min_tokens ban); else 1."""
    if most == 1 or may_admit:
        return 1
    for seq in running:
        p = seq.params
        if (seq.guide is not None or p.use_beam_search or p.uses_penalties or seq.forks > 1
                or seq.num_output_tokens + seq.num_pending < p.min_tokens
                or seq.num_computed_tokens + 1 != seq.num_tokens):
            return 1
    return most
