"""Perplexity of a text under an engine's model exactly as the engine runs it: its weights (packed or
not), its KV cache's dtype and layout, its attention backend.

The text's tokens are cut into windows of `context` tokens, each scored as a fresh sequence: its
tokens go through the model in prefill chunks of `chunk` tokens, so every chunk after the first reads
the earlier ones' K/V back from the pages, stored in the cache's dtype (a bfloat16 cache's rounding
counts, as it does in the engine). Each token but a window's first is scored by the logprob the model
gave it from the tokens before it; perplexity is exp of their mean negative logprob.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas import AttentionMetadata, KVCache, init_kv_cache


def make_forward(graphdef: nnx.GraphDef, *, attn_backend: str):
    """The model's call as the engine's step makes it (the state merged into the graph under jit, the
    cache donated), with no sampler: `logits, kv_cache = forward(state, input_ids, positions, kv_cache,
    metadata, logits_indices)`."""

    @functools.partial(jax.jit, donate_argnames=("kv_cache",))
    def forward(state: nnx.State, input_ids, positions, kv_cache: KVCache, metadata: AttentionMetadata, logits_indices):
        return nnx.merge(graphdef, state)(input_ids, positions, kv_cache, metadata, logits_indices,
                                          attn_backend=attn_backend)

    return forward


@jax.jit
def _target_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits: f32 [T, vocab]; targets: int32 [T] -> f32 [T], log p(target) of each row."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[:, None], axis=-1)[:, 0]


def window_logprobs(engine, window: list[int], *, chunk: int, forward=None, kv_cache=None):
    """(f32 [len(window) - 1] logprob of each token after the first, the KV cache after the window).

    engine: an LLMEngine on one device; forward, kv_cache: reused from a previous window (made here if None).
    """
    resolved, config = engine.resolved, engine.model_config
    block_size, num_blocks = resolved.block_size, -(-len(window) // resolved.block_size)
    if forward is None:
        forward = make_forward(engine.runner.graph.graphdef, attn_backend=resolved.attention_backend)
    if kv_cache is None or kv_cache.num_blocks < num_blocks + 1:
        kv_cache = init_kv_cache(config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim,
                                 jnp.dtype(resolved.kv_cache_dtype), layout=resolved.kv_layout)
    blocks = np.arange(1, num_blocks + 1, dtype=np.int32)  # block 0 is the null block, as in the pool
    tokens = np.asarray(window, np.int32)

    def padded(values, fill):  # every chunk one shape: one compiled program
        out = np.full(chunk, fill, np.int32)
        out[: len(values)] = values
        return out

    scores = []
    for start in range(0, len(window) - 1, chunk):
        pos = np.arange(start, min(start + chunk, len(window)), dtype=np.int32)
        metadata = AttentionMetadata(
            slot_mapping=padded(blocks[pos // block_size] * block_size + pos % block_size, -1),
            block_tables=blocks[None], seq_lens=np.array([pos[-1] + 1], np.int32),
            query_start_loc=np.array([0, len(pos)], np.int32), max_query_len=chunk)
        logits, kv_cache = forward(engine.runner.state, padded(tokens[pos], 0), padded(pos, 0), kv_cache, metadata,
                                   np.arange(chunk, dtype=np.int32))
        targets = tokens[start + 1 : start + chunk + 1]  # what each row predicts; the last row of a window none
        scores.append(np.asarray(_target_logprobs(logits, padded(targets, 0)))[: len(targets)])
    return np.concatenate(scores), kv_cache


def perplexity(engine, token_ids: list[int], *, context: int = 1024, chunk: int = 256) -> dict:
    """{"perplexity", "mean_nll", "tokens_scored", "windows"} of token_ids under the engine's model."""
    if context < 2 or chunk < 1:
        raise ValueError(f"context must be >= 2 and chunk >= 1, got {context} and {chunk}")
    forward = make_forward(engine.runner.graph.graphdef, attn_backend=engine.resolved.attention_backend)
    kv_cache, scores = None, []
    windows = [token_ids[i : i + context] for i in range(0, len(token_ids), context)]
    windows = [w for w in windows if len(w) >= 2]
    for window in windows:
        logprobs, kv_cache = window_logprobs(engine, window, chunk=chunk, forward=forward, kv_cache=kv_cache)
        scores.append(logprobs)
    nll = -float(np.mean(np.concatenate(scores)))
    return {"perplexity": float(np.exp(nll)), "mean_nll": nll, "tokens_scored": sum(map(len, scores)),
            "windows": len(windows)}
