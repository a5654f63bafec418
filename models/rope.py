"""Rotary position embeddings in Hugging Face's rotate_half convention (the two halves of a head rotate
together, not interleaved pairs as in llama.cpp: the GGUF reader un-permutes q/k weights to match).

A model may rotate its layers at different speeds (Gemma 3: sliding layers at base 10,000, full ones at
the config's base and scaling). `inv_freq` gives every set of frequencies the model uses side by side,
so the engine makes one cos/sin table per step without knowing the family, and `slot` says which set a
layer takes.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def slot(config: ModelConfig, layer: int) -> int:
    """Which frequency set of `inv_freq` rotates layer `layer`: 1 for a sliding layer with a base of
    its own (config.rope_local_theta), else 0."""
    return int(config.rope_local_theta is not None and config.window(layer) is not None)


def inv_freq(config: ModelConfig) -> np.ndarray:
    """float32 [num_slots * head_dim // 2]: rotation speed of each frequency, slot 0's (the config's base,
    llama3 or linear scaling applied) then, where config.rope_local_theta is set, slot 1's."""
    sets = [_scaled(config, _base(config.rope_theta, config.head_dim))]
    if config.rope_local_theta is not None:
        sets.append(_base(config.rope_local_theta, config.head_dim))
    return np.concatenate(sets).astype(np.float32)


def _base(theta: float, dim: int) -> np.ndarray:
    """float64 [dim // 2]: the unscaled frequencies of base `theta`."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _scaled(config: ModelConfig, freq: np.ndarray) -> np.ndarray:
    """The config's scaling applied to frequencies `freq` (float64 [head_dim // 2])."""
    freq = freq / config.rope_linear_factor
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
    return freq


def cos_sin(positions: jax.Array | np.ndarray, freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """positions: int32 [num_tokens]; freq: float32 [F] (inv_freq's) -> cos, sin float32 [num_tokens, F],
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
