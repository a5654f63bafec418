"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) as flax.nnx modules over a paged KV cache.

The forward pass takes one flat, ragged batch of new tokens (prefill chunks and decode tokens of
several sequences laid end to end), as the serving engine schedules them.

Weight layouts are chosen for the CPU and for tensor parallelism at once:
- q/k/v are one weight [hidden, num_kv_heads, group + 2, head_dim]: per KV head its `group` query
  heads, then its k, then its v. One matmul instead of three (more work per call is faster here), and
  splitting the kv-head axis over devices hands each device whole q/k/v groups.
- gate/up are one weight [hidden, 2, intermediate], split over devices on the intermediate axis.
Every Param carries `out_sharding`: a partition spec over the mesh axis TP_AXIS (column-parallel
on output dims, row-parallel on input dims, embeddings on vocab); `nnx.get_partition_spec(state)`
reads them. Construction never shards (eager_sharding=False): placing is the loader's or engine's call.

On the CPU, `LlamaForCausalLM.pack_for_cpu` gives a copy whose matmul weights are packed in column
panels for the C++ matmul (kernels_pallas/cpu/linear.cc); each module's static `packed` says which form
it holds.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas
from kernels_pallas import AttentionMetadata, KVCache, cpu_kernel
from models import rope
from models.config import ModelConfig
from models.sharding import TP_AXIS, per_kv_head


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], sharding: tuple, dtype) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=sharding, eager_sharding=False)


def _linear(x: jax.Array, w: jax.Array, out_shape: tuple[int, ...], packed: bool, rows=None,
            panels: jax.Array | None = None, onednn_rows: int = 0) -> jax.Array:
    """x: [num_tokens, K] @ w -> [num_tokens, *out_shape]. w is [K, *out_shape], or where packed its
    column panels (cpu_kernel.pack_columns of w as [K, N]; int8 ones: pack_int8), multiplied by the
    C++ kernel, which computes only the leading `rows` rows (int32 scalar: the step's real tokens;
    None: all) and gives zeros for the padding after them. panels: the same weight in oneDNN's layout
    (cpu_kernel.pack_panels), which a step of at least onednn_rows tokens multiplies by instead."""
    if not packed:
        return jnp.tensordot(x, w, axes=1)
    if panels is not None and onednn_rows and x.shape[0] >= onednn_rows:
        linear, w = cpu_kernel.linear_onednn_cpu, panels
    else:
        linear = cpu_kernel.linear_int8_cpu if w.dtype == jnp.int8 else cpu_kernel.linear_cpu
    with jax.named_scope("matmul"):  # the profile's name for it (paged_jax/research/step_profile.py)
        return linear(x, w, math.prod(out_shape), rows).reshape(x.shape[0], *out_shape)


def _pack(param: nnx.Param, weight: jax.Array, pack=cpu_kernel.pack_columns) -> None:
    """Hold weight [K, *out] packed, for _linear; packed weights are never split over devices."""
    param.set_value(pack(weight.reshape(weight.shape[0], -1)))
    param.set_metadata(out_sharding=(None,) * 3)


def _value(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]


_normal = jax.nn.initializers.normal(0.02)
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.weight = _param(rngs, _ones, (size,), (None,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [num_tokens, size] -> same shape and dtype; statistics in float32 as transformers does."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.qkv = _param(rngs, _normal, (c.hidden_size, c.num_kv_heads, c.group_size + 2, c.head_dim),
                          (None, TP_AXIS, None, None), dtype)
        if c.qkv_bias:
            self.qkv_bias = _param(rngs, _zeros, (c.num_kv_heads, c.group_size + 2, c.head_dim),
                                   (TP_AXIS, None, None), dtype)
        self.o = _param(rngs, _normal, (c.num_heads * c.head_dim, c.hidden_size), (TP_AXIS, None), dtype)
        self.packed = False
        self.onednn_rows = 0  # as MLP's
        self.qkv_panels: nnx.Param | None = nnx.data(None)
        self.o_panels: nnx.Param | None = nnx.data(None)

    def __call__(self, x, cos, sin, k_pages, v_pages, metadata: AttentionMetadata, attn_backend: str,
                 kv_layout: str, mesh=None):
        """x: [num_tokens, hidden]; cos, sin: float32 [num_tokens, head_dim // 2];
        k_pages, v_pages: this layer's pages in kv_layout (kernels_pallas/layout.py); mesh: a
        jax.sharding.Mesh to split attention over (models/sharding.py), or None on one device.

        Returns the output [num_tokens, hidden] and the pages holding this step's K/V.
        """
        c = self.config
        g = c.group_size
        rows = metadata.query_start_loc[-1]  # the real tokens, before the bucket's padding
        qkv = _linear(x, self.qkv[...], (c.num_kv_heads, g + 2, c.head_dim), self.packed, rows,
                      _value(self.qkv_panels), self.onednn_rows)
        if c.qkv_bias:
            qkv = qkv + self.qkv_bias[...]
        qk = rope.apply(qkv[:, :, : g + 1], cos, sin)  # q and k rotate together: one fused op
        q = qk[:, :, :g].reshape(x.shape[0], c.num_heads, c.head_dim)
        k, v = qk[:, :, g], qkv[:, :, g + 1]  # [num_tokens, num_kv_heads, head_dim]

        def attend(q, k, v, k_pages, v_pages, metadata):
            # Named scopes label these ops in the compiled program (paged_jax/research/step_profile.py reads them).
            with jax.named_scope("kv_write"):
                k_pages, v_pages = kernels_pallas.write_kv(k_pages, v_pages, metadata.slot_mapping, k, v, kv_layout)
            with jax.named_scope("attention"):
                out = kernels_pallas.paged_attention(q, k_pages, v_pages, metadata, scale=c.head_dim**-0.5,
                                                     backend=attn_backend, layout=kv_layout)
            return out, k_pages, v_pages

        out, k_pages, v_pages = per_kv_head(attend, mesh, kv_layout)(q, k, v, k_pages, v_pages, metadata)
        out = _linear(out.reshape(x.shape[0], -1), self.o[...], (c.hidden_size,), self.packed, rows,
                      _value(self.o_panels), self.onednn_rows)
        return out, k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.gate_up = _param(rngs, _normal, (c.hidden_size, 2, c.intermediate_size), (None, None, TP_AXIS), dtype)
        self.down = _param(rngs, _normal, (c.intermediate_size, c.hidden_size), (TP_AXIS, None), dtype)
        self.config = c
        self.packed = False
        self.onednn_rows = 0  # pack_for_cpu's: steps of this many tokens and more multiply through oneDNN
        self.gate_up_panels: nnx.Param | None = nnx.data(None)
        self.down_panels: nnx.Param | None = nnx.data(None)

    def __call__(self, x: jax.Array, rows=None) -> jax.Array:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]; SwiGLU. rows: int32 scalar, the leading rows
        that are real tokens (the packed matmuls skip the rest), or None: all."""
        c = self.config
        gate_up = _linear(x, self.gate_up[...], (2, c.intermediate_size), self.packed, rows,
                          _value(self.gate_up_panels), self.onednn_rows)
        return _linear(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], self.down[...], (c.hidden_size,), self.packed,
                       rows, _value(self.down_panels), self.onednn_rows)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, k_pages, v_pages, metadata: AttentionMetadata, attn_backend: str,
                 kv_layout: str, mesh=None):
        """Shapes as Attention.__call__; returns (x, k_pages, v_pages)."""
        attn, k_pages, v_pages = self.attn(self.input_norm(x), cos, sin, k_pages, v_pages, metadata, attn_backend,
                                           kv_layout, mesh)
        x = x + attn
        return x + self.mlp(self.post_attention_norm(x), metadata.query_start_loc[-1]), k_pages, v_pages


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_backend", "kv_layout", "mesh"))
def _decoder_layer(graphdef, state, x, cos, sin, k_pages, v_pages, metadata, *, attn_backend: str, kv_layout: str,
                   mesh=None):
    """DecoderLayer.__call__ as a function of its state, jitted on its own: every layer has the same
    structure and shapes, so inside the step all share one trace and one lowering, and tracing the
    step costs one layer, not num_layers (seconds at each start-up). XLA inlines the calls again when
    it compiles, so the compiled step is the same."""
    return nnx.merge(graphdef, state)(x, cos, sin, k_pages, v_pages, metadata, attn_backend, kv_layout, mesh)


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed = _param(rngs, _normal, (c.vocab_size, c.hidden_size), (TP_AXIS, None), dtype)
        self.layers = nnx.List([DecoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, rngs=rngs)
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, _normal, (c.hidden_size, c.vocab_size), (None, TP_AXIS), dtype)
        self.lm_head_int8: nnx.Param | None = nnx.data(None)  # pack_for_cpu's, with quantization "int8"
        self.packed = False

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        logits_indices: jax.Array,
        *,
        attn_backend: str = "auto",
        mesh=None,
    ) -> tuple[jax.Array, KVCache]:
        """One engine step over a flat ragged batch: `hidden_states`, then `logits` of the wanted rows.

        logits_indices: int32 [num_seqs], rows of the flat batch whose logits are wanted; the other
        arguments as `hidden_states` takes them.
        Returns logits float32 [num_seqs, vocab] and the cache holding this step's K/V.
        """
        x, kv_cache = self.hidden_states(input_ids, positions, kv_cache, metadata, attn_backend=attn_backend,
                                         mesh=mesh)
        # Only the sampled rows go through the final norm and the lm_head, the largest matmul.
        return self.logits(x[logits_indices]), kv_cache

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache, metadata: AttentionMetadata,
                      *, attn_backend: str = "auto", mesh=None,
                      cos_sin: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, KVCache]:
        """The decoder layers over a flat ragged batch, before the final norm.

        input_ids: int32 [num_tokens]; padding tokens carry slot -1 in metadata.slot_mapping.
        positions: int32 [num_tokens], each token's position in its sequence.
        kv_cache: pages of every layer, in kv_cache.layout.
        mesh: the jax.sharding.Mesh the parameters and pages are split over, or None (one device).
        cos_sin: rope.cos_sin(positions, rope.inv_freq(config)), float32 [num_tokens, head_dim // 2] each,
            where the caller has them (the engine makes them on the host); else computed here. Computed
            in the program, XLA fuses them into every layer's rotary op and so evaluates cos and sin
            again for every layer and head: 34 ms of a 1,024-token step on the CPU.
        Returns the last layer's output [num_tokens, hidden] and the cache holding this step's K/V.
        """
        cos, sin = cos_sin if cos_sin is not None else rope.cos_sin(positions, rope.inv_freq(self.config))
        if self.packed and self.config.tie_word_embeddings:  # the embedding's transpose, packed
            x = self.embed[...][input_ids // cpu_kernel.PANEL, :, input_ids % cpu_kernel.PANEL]
        else:
            x = self.embed[...][input_ids]
        ks, vs = [], []
        for layer, k_pages, v_pages in zip(self.layers, kv_cache.k, kv_cache.v, strict=True):
            x, k_pages, v_pages = _decoder_layer(*nnx.split(layer), x, cos, sin, k_pages, v_pages, metadata,
                                                 attn_backend=attn_backend, kv_layout=kv_cache.layout, mesh=mesh)
            ks.append(k_pages)
            vs.append(v_pages)
        return x, dataclasses.replace(kv_cache, k=tuple(ks), v=tuple(vs))

    def logits(self, x: jax.Array) -> jax.Array:
        """x: [rows, hidden], rows of `hidden_states` -> float32 [rows, vocab]: the final norm and the lm_head."""
        x = self.norm(x)
        if self.packed:
            if self.lm_head_int8 is not None:
                lm_head = self.lm_head_int8
            else:
                lm_head = self.embed if self.config.tie_word_embeddings else self.lm_head
            return _linear(x, lm_head[...], (self.config.vocab_size,), packed=True)
        if self.config.tie_word_embeddings:
            return jnp.einsum("th,vh->tv", x, self.embed[...], preferred_element_type=jnp.float32)
        return jnp.einsum("th,hv->tv", x, self.lm_head[...], preferred_element_type=jnp.float32)

    def pack_for_cpu(self, quantization: str | None = None, onednn_rows: int = 0) -> "LlamaForCausalLM":
        """A copy of the model whose matmul weights are packed in column panels for the C++ CPU matmul
        (kernels_pallas/cpu/linear.cc): XLA's dot repacks its weight on every call, which took most of a
        decode step's matmul time. Float32, one device (the weights are not split); this model is
        unchanged. A tied embedding is packed as the lm_head's weight, and looked up in that form.

        quantization "int8": the layers' weights and the lm_head are quantized per column
        (cpu_kernel.pack_int8) for the int8 matmul (linear_int8.cc); the embedding stays float32 for its
        lookup (a tied one is then held twice, +28 MB for SmolLM2). A float32 lm_head was half of what an
        int8 decode step read (113 of 221 MB); quantized, W1 ran about 5% faster offline and the
        perplexity of scripts/eval_precision.py rose from +1.06% to +1.59% against float32's.

        onednn_rows > 0 (float32 only): the layers' weights are also held in oneDNN's layout
        (cpu_kernel.pack_panels), and steps of at least onednn_rows tokens multiply through oneDNN
        (kernels_pallas/cpu/onednn_linear.cc), faster than the C++ matmul on prefill-sized row counts;
        the layers' weights are then held twice (+425 MB for SmolLM2)."""
        if onednn_rows and quantization is not None:
            raise ValueError("the oneDNN matmul runs float32 weights, not quantized ones")
        model = nnx.clone(self)  # new modules and variables, over the same arrays until packed
        pack = cpu_kernel.pack_int8 if quantization == "int8" else cpu_kernel.pack_columns
        for layer in model.layers:
            for module, names in ((layer.attn, ("qkv", "o")), (layer.mlp, ("gate_up", "down"))):
                for name in names:
                    param = getattr(module, name)
                    if onednn_rows:
                        setattr(module, f"{name}_panels", nnx.Param(cpu_kernel.pack_panels(
                            param[...].reshape(param.shape[0], -1))))
                    _pack(param, param[...], pack)
                module.packed, module.onednn_rows = True, onednn_rows
        if quantization == "int8":
            head = model.embed[...].T if model.config.tie_word_embeddings else model.lm_head[...]
            model.lm_head_int8 = nnx.Param(cpu_kernel.pack_int8(head))
        if model.config.tie_word_embeddings:
            _pack(model.embed, model.embed[...].T)
        else:
            _pack(model.lm_head, model.lm_head[...])
        model.packed = True
        return model
