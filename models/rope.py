"""Rotary position embeddings in Hugging Face's rotate_half convention (the two halves of a head rotate
together, not interleaved pairs as in llama.cpp: the GGUF reader un-permutes q/k weights to match)."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 [head_dim // 2]: rotation speed of each frequency, llama3 scaling applied."""
    dim = config.head_dim
    freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    scaling = config.rope_scaling
    if scaling is not None:
        old_len = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / freq
        # Short wavelengths keep their speed, long ones slow down by `factor`, and those between
        # low_freq_wavelen and high_freq_wavelen blend the two.
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * freq / scaling.factor + smooth * freq
        freq = np.where(
            wavelen < old_len / scaling.high_freq_factor,
            freq,
            np.where(wavelen > old_len / scaling.low_freq_factor, freq / scaling.factor, blended),
        )
    return freq.astype(np.float32)


def cos_sin(positions: jax.Array | np.ndarray, freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: int32 [num_tokens]; freq: float32 [head_dim // 2] -> cos, sin float32 [num_tokens, head_dim // 2],
    numpy arrays for numpy positions (the engine's host side), else jax arrays."""
    xp = np if isinstance(positions, np.ndarray) else jnp
    angles = positions.astype(np.float32)[:, None] * xp.asarray(freq, np.float32)[None, :]
    return xp.cos(angles), xp.sin(angles)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [num_tokens, ..., head_dim]; cos, sin: float32 [num_tokens, head_dim // 2]. Returns x's shape and dtype."""
    extra = (None,) * (x.ndim - 2)
    cos, sin = cos[:, *extra, :], sin[:, *extra, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
