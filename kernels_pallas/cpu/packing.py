"""Weights packed for the CPU matmuls, once, when the model is loaded: float32 column panels for
linear.cc, oneDNN's blocked layout for onednn_linear.cc, and int8 panels with per-column scales for
linear_int8.cc; with the inverse of each where a test or a reference needs the weight back."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import cdiv

PANEL = 16  # columns per panel of a packed weight (linear.cc's kPanel)
ONEDNN_PANEL, ONEDNN_DEPTH = 64, 16  # oneDNN's BA16a64b: panels of 64 columns, K rounded up to 16
INT8_GROUP = 4  # k values a dot-product lane sums (linear_int8.cc's kGroup)


def pack_columns(w: jax.Array) -> jax.Array:
    """w: f32 [K, N] -> [ceil(N / PANEL), K, PANEL]: column panels for linear_cpu, the last one padded
    with zero columns. Done once per weight, when the model is loaded."""
    k, n = w.shape
    panels = cdiv(n, PANEL)
    w = jnp.pad(w, ((0, 0), (0, panels * PANEL - n)))
    return w.reshape(k, panels, PANEL).transpose(1, 0, 2)


def unpack_columns(packed: jax.Array, n: int) -> jax.Array:
    """The inverse of pack_columns: [panels, K, PANEL] -> [K, n]."""
    return packed.transpose(1, 0, 2).reshape(packed.shape[1], -1)[:, :n]


def pack_panels(w: jax.Array) -> jax.Array:
    """w: f32 [K, N] -> [ceil(N / 64), K rounded up to 16, 64], oneDNN's BA16a64b layout for
    linear_onednn_cpu, zeros in the padding. Done once per weight, when the model is loaded."""
    k, n = w.shape
    panels, depth = cdiv(n, ONEDNN_PANEL), cdiv(k, ONEDNN_DEPTH) * ONEDNN_DEPTH
    w = jnp.pad(w, ((0, depth - k), (0, panels * ONEDNN_PANEL - n)))
    return w.reshape(depth, panels, ONEDNN_PANEL).transpose(1, 0, 2)


def pack_int8(w: jax.Array) -> jax.Array:
    """w: f32 [K, N] -> int8 [ceil(N / PANEL), ceil(K / 4) + 2, 64], for linear_int8_cpu.

    Each column is quantized symmetrically, q = round(w / s) with s = max|w_column| / 127; a panel of
    PANEL columns holds, per group of 4 k, each column's 4 values side by side (the order of the dot
    product of bytes), then its columns' scales (float32) and sums of q (int32) as bytes. Done once
    per weight, at load.
    """
    k, n = w.shape
    panels, groups = -(-n // PANEL), -(-k // INT8_GROUP)
    scale = jnp.max(jnp.abs(w), axis=0) / 127
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    q = jnp.pad(q, ((0, groups * INT8_GROUP - k), (0, panels * PANEL - n)))
    body = q.reshape(groups, INT8_GROUP, panels, PANEL).transpose(2, 0, 3, 1).reshape(panels, groups, -1)
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a.reshape(panels, PANEL), jnp.int8).reshape(panels, 1, -1)
    scales = jnp.pad(scale.astype(jnp.float32), (0, panels * PANEL - n), constant_values=1.0)
    return jnp.concatenate([body, as_bytes(scales), as_bytes(q.astype(jnp.int32).sum(0))], axis=1)


def unpack_int8(packed: jax.Array, k: int, n: int) -> jax.Array:
    """The float32 [k, n] weight that pack_int8's result stands for: each q times its column's scale."""
    panels, groups = packed.shape[0], packed.shape[1] - 2
    q = packed[:, :groups].reshape(panels, groups, PANEL, INT8_GROUP).transpose(1, 3, 0, 2)
    scales = jax.lax.bitcast_convert_type(packed[:, groups].reshape(panels, PANEL, 4), jnp.float32)
    return (q.reshape(groups * INT8_GROUP, -1).astype(jnp.float32) * scales.reshape(-1))[:k, :n]
