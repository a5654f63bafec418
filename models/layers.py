"""The layers every family is built of, as flax.nnx modules over a flat ragged batch and a paged KV cache:
RMSNorm, attention (GQA with rotary embeddings, optional q/k norms and a sliding window) and the gated MLP.

Weight layouts are chosen for the CPU and for tensor parallelism at once:
- q/k/v are one weight [hidden, num_kv_heads, group + 2, head_dim]: per KV head its `group` query
  heads, then its k, then its v. One matmul instead of three (more work per call is faster here), and
  splitting the kv-head axis over devices hands each device whole q/k/v groups.
- gate/up are one weight [hidden, 2, intermediate], split over devices on the intermediate axis.
Every Param carries `out_sharding`: a partition spec over the mesh axis TP_AXIS (column-parallel
on output dims, row-parallel on input dims, embeddings on vocab); `nnx.get_partition_spec(state)`
reads them. Construction never shards (eager_sharding=False): placing is the loader's or engine's call.

On the CPU, a model's `pack_for_cpu` (decoder.py) packs the matmul weights in column panels for the C++
matmul (kernels_pallas/cpu/linear.cc); each module's static `packed` says which form it holds.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas
from kernels_pallas import AttentionMetadata, cpu_kernel
from models import rope
from models.config import ModelConfig
from models.sharding import TP_AXIS, per_kv_head


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], sharding: tuple, dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=sharding, eager_sharding=False)


def linear(x: jax.Array, w: jax.Array, out_shape: tuple[int, ...], packed: bool, rows=None,
           panels: jax.Array | None = None, onednn_rows: int = 0, add=None) -> jax.Array:
    """x: [num_tokens, K] @ w -> [num_tokens, *out_shape]. w is [K, *out_shape], or where packed its
    column panels (cpu_kernel.pack_columns of w as [K, N]; int8 ones: pack_int8), multiplied by the
    C++ kernel, which computes only the leading `rows` rows (int32 scalar: the step's real tokens;
    None: all) and gives zeros for the padding after them. panels: the same weight in oneDNN's layout
    (cpu_kernel.pack_panels), which a step of at least onednn_rows tokens multiplies by instead. add: a
    packed LoRA delta to add after the matmul (lora_packed.SlotAddend or DenseAddend)."""
    n = math.prod(out_shape)
    if not packed:
        out = jnp.tensordot(x, w, axes=1)
        return out if add is None else add.added_to(out.reshape(-1, n)).reshape(out.shape)
    if panels is not None and onednn_rows and x.shape[0] >= onednn_rows:
        matmul, w = cpu_kernel.linear_onednn_cpu, panels
    else:
        matmul = cpu_kernel.linear_int8_cpu if w.dtype == jnp.int8 else cpu_kernel.linear_cpu
    with jax.named_scope("matmul"):  # the profile's name for it (paged_jax/research/step_profile.py)
        out = matmul(x, w, n, rows)
        return (out if add is None else add.added_to(out)).reshape(x.shape[0], *out_shape)


def pack(param: nnx.Param, weight: jax.Array, packer=cpu_kernel.pack_columns) -> None:
    """Hold weight [K, *out] packed, for `linear`; packed weights are never split over devices."""
    param.set_value(packer(weight.reshape(weight.shape[0], -1)))
    param.set_metadata(out_sharding=(None,) * 3)


def value(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]


normal = jax.nn.initializers.normal(0.02)
zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones

ACTIVATIONS = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Qwen)
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GeGLU (Gemma)
}


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. Llama's form scales by w; Gemma's (unit_offset) by 1 + w, whose
    checkpoints store w around 0."""

    def __init__(self, size: int, eps: float, *, dtype, rngs: nnx.Rngs, unit_offset: bool = False):
        self.weight = param(rngs, zeros if unit_offset else ones, (size,), (None,), dtype)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., size] -> same shape and dtype; statistics in float32 as transformers does, and each
        form rounds where transformers' does (Llama: before the weight; Gemma: after it)."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


class Attention(nnx.Module):
    """Self-attention of one layer: fused q/k/v, q/k norms where the config has them (Qwen3, Gemma 3),
    rotary embeddings, the paged cache write and attention, and the output projection.

    window: this layer's sliding window (a query at position p sees keys at positions > p - window),
    or None for full attention; rope_slot: which of rope.inv_freq's frequency sets rotates it. Both
    are static: layers that differ in them trace apart."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, window: int | None = None, rope_slot: int = 0,
                 unit_offset_norms: bool = False):
        c = config
        self.config = c
        self.window = window
        self.rope_slot = rope_slot
        self.qkv = param(rngs, normal, (c.hidden_size, c.num_kv_heads, c.group_size + 2, c.head_dim),
                         (None, TP_AXIS, None, None), dtype)
        if c.qkv_bias:
            self.qkv_bias = param(rngs, zeros, (c.num_kv_heads, c.group_size + 2, c.head_dim),
                                  (TP_AXIS, None, None), dtype)
        if c.qk_norm:  # over each head's head_dim, one weight for all heads
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, rngs=rngs, unit_offset=unit_offset_norms)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype, rngs=rngs, unit_offset=unit_offset_norms)
        self.o = param(rngs, normal, (c.num_heads * c.head_dim, c.hidden_size), (TP_AXIS, None), dtype)
        self.packed = False
        self.onednn_rows = 0  # as MLP's
        self.qkv_panels: nnx.Param | None = nnx.data(None)
        self.o_panels: nnx.Param | None = nnx.data(None)

    def __call__(self, x, cos, sin, k_pages, v_pages, metadata: AttentionMetadata, attn_backend: str,
                 kv_layout: str, mesh=None, lora=None):
        """x: [num_tokens, hidden]; cos, sin: float32 [num_tokens, num_slots * head_dim // 2], every
        frequency set of rope.inv_freq side by side (this layer takes its rope_slot's);
        k_pages, v_pages: this layer's pages in kv_layout (kernels_pallas/layout.py); mesh: a
        jax.sharding.Mesh to split attention over (models/sharding.py), or None on one device;
        lora: this layer's lora.LayerLoRA, whose deltas add to q/k/v and o, or None (no adapters).

        Returns the output [num_tokens, hidden] and the pages holding this step's K/V.
        """
        c = self.config
        g = c.group_size
        rows = metadata.query_start_loc[-1]  # the real tokens, before the bucket's padding
        add = lora.addend("qkv", x, rows) if lora is not None else None
        qkv = linear(x, self.qkv[...], (c.num_kv_heads, g + 2, c.head_dim), self.packed, rows,
                     value(self.qkv_panels), self.onednn_rows, add)
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...]
        if lora is not None and add is None:  # after the bias, as PEFT adds it to the base layer's output
            dq, dk, dv = lora.delta("qkv", x, rows)
            kv_heads = (x.shape[0], c.num_kv_heads, 1, c.head_dim)
            qkv = qkv + jnp.concatenate([dq.reshape(x.shape[0], c.num_kv_heads, g, c.head_dim), dk.reshape(kv_heads),
                                         dv.reshape(kv_heads)], axis=2)
        qk = qkv[:, :, : g + 1]
        if c.qk_norm:  # before the rotation, as Qwen3 and Gemma 3 do
            qk = jnp.concatenate([self.q_norm(qk[:, :, :g]), self.k_norm(qk[:, :, g:])], axis=2)
        half = c.head_dim // 2
        own = slice(self.rope_slot * half, (self.rope_slot + 1) * half)
        qk = rope.apply(qk, cos[:, own], sin[:, own])  # q and k rotate together: one fused op
        q = qk[:, :, :g].reshape(x.shape[0], c.num_heads, c.head_dim)
        k, v = qk[:, :, g], qkv[:, :, g + 1]  # [num_tokens, num_kv_heads, head_dim]

        def attend(q, k, v, k_pages, v_pages, metadata):
            # Named scopes label these ops in the compiled program (paged_jax/research/step_profile.py reads them).
            with jax.named_scope("kv_write"):
                k_pages, v_pages = kernels_pallas.write_kv(k_pages, v_pages, metadata.slot_mapping, k, v, kv_layout)
            with jax.named_scope("attention"):
                out = kernels_pallas.paged_attention(q, k_pages, v_pages, metadata, scale=c.attention_scale,
                                                     backend=attn_backend, layout=kv_layout,
                                                     sliding_window=self.window, soft_cap=c.attn_logit_softcapping)
            return out, k_pages, v_pages

        out, k_pages, v_pages = per_kv_head(attend, mesh, kv_layout)(q, k, v, k_pages, v_pages, metadata)
        out = out.reshape(x.shape[0], -1)
        add = lora.addend("o", out, rows) if lora is not None else None
        projected = linear(out, self.o[...], (c.hidden_size,), self.packed, rows, value(self.o_panels),
                           self.onednn_rows, add)
        if lora is not None and add is None:
            projected = projected + lora.delta("o", out, rows)[0]
        return projected, k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.gate_up = param(rngs, normal, (c.hidden_size, 2, c.intermediate_size), (None, None, TP_AXIS), dtype)
        self.down = param(rngs, normal, (c.intermediate_size, c.hidden_size), (TP_AXIS, None), dtype)
        self.config = c
        self.packed = False
        self.onednn_rows = 0  # pack_for_cpu's: steps of this many tokens and more multiply through oneDNN
        self.gate_up_panels: nnx.Param | None = nnx.data(None)
        self.down_panels: nnx.Param | None = nnx.data(None)

    def __call__(self, x: jax.Array, rows=None, lora=None) -> jax.Array:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]; act(gate) * up, then down (SwiGLU or GeGLU as
        config.hidden_act says). rows: int32 scalar, the leading rows that are real tokens (the packed
        matmuls skip the rest), or None: all. lora: the layer's lora.LayerLoRA, or None."""
        c = self.config
        add = lora.addend("gate_up", x, rows) if lora is not None else None
        gate_up = linear(x, self.gate_up[...], (2, c.intermediate_size), self.packed, rows,
                         value(self.gate_up_panels), self.onednn_rows, add)
        if lora is not None and add is None:
            gate_up = gate_up + jnp.stack(lora.delta("gate_up", x, rows), axis=1)
        hidden = ACTIVATIONS[c.hidden_act](gate_up[:, 0]) * gate_up[:, 1]
        add = lora.addend("down", hidden, rows) if lora is not None else None
        out = linear(hidden, self.down[...], (c.hidden_size,), self.packed, rows, value(self.down_panels),
                     self.onednn_rows, add)
        return out if lora is None or add is not None else out + lora.delta("down", hidden, rows)[0]
