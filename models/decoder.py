"""A decoder-only language model over a paged KV cache: the embedding, the stack of layers, the final
norm and the lm_head, the same in every family. A family (llama.py, gemma3.py) gives its layer and
what it changes around the stack (Gemma's embedding scale, its norm form).

The forward pass takes one flat, ragged batch of new tokens (prefill chunks and decode tokens of
several sequences laid end to end), as the serving engine schedules them. Every family's model is
called the same way, so the engine knows none of them.

On the CPU, `DecoderLM.pack_for_cpu` gives a copy whose matmul weights are packed in column panels for
the C++ matmul (kernels_pallas/cpu/linear.cc).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import AttentionMetadata, KVCache, cpu_kernel
from models import layers, rope
from models.kv_groups import kv_groups
from models.config import ModelConfig
from models.lora import LoRARows, LoRAWeights
from models.moe import SparseMoE
from models.sharding import TP_AXIS


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_backend", "kv_layout", "mesh"))
def _decoder_layer(graphdef, state, x, cos, sin, k_pages, v_pages, metadata, lora=None, *, attn_backend: str,
                   kv_layout: str, mesh=None):
    """A layer's __call__ as a function of its state, jitted on its own: layers of the same structure
    and shapes share one trace and one lowering inside the step, and tracing the step costs one layer
    per kind (Gemma 3's sliding and full layers are two), not num_layers (seconds at each start-up).
    XLA inlines the calls again when it compiles, so the compiled step is the same."""
    return nnx.merge(graphdef, state)(x, cos, sin, k_pages, v_pages, metadata, attn_backend, kv_layout, mesh, lora)


class DecoderLM(nnx.Module):
    """What the engine calls. Subclasses set `layer_class` (built as layer_class(config, i, dtype=...,
    rngs=...)) and, where they differ from Llama, `unit_offset_norms` (Gemma's 1 + w form) and
    `scale_embeddings` (Gemma's embeddings times sqrt(hidden))."""

    layer_class: type
    unit_offset_norms = False
    scale_embeddings = False

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed = layers.param(rngs, layers.normal, (c.vocab_size, c.hidden_size), (TP_AXIS, None), dtype)
        self.layers = nnx.List([self.layer_class(c, i, dtype=dtype, rngs=rngs) for i in range(c.num_layers)])
        self.norm = layers.RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype, rngs=rngs,
                                   unit_offset=self.unit_offset_norms)
        if not c.tie_word_embeddings:
            self.lm_head = layers.param(rngs, layers.normal, (c.hidden_size, c.vocab_size), (None, TP_AXIS), dtype)
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
        lora: LoRAWeights | None = None,
        lora_rows: LoRARows | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """One engine step over a flat ragged batch: `hidden_states`, then `logits` of the wanted rows.

        logits_indices: int32 [num_seqs], rows of the flat batch whose logits are wanted; the other
        arguments as `hidden_states` takes them.
        Returns logits float32 [num_seqs, vocab] and the cache holding this step's K/V.
        """
        x, kv_cache = self.hidden_states(input_ids, positions, kv_cache, metadata, attn_backend=attn_backend,
                                         mesh=mesh, lora=lora, lora_rows=lora_rows)
        # Only the sampled rows go through the final norm and the lm_head, the largest matmul.
        return self.logits(x[logits_indices]), kv_cache

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                      metadata: AttentionMetadata | tuple[AttentionMetadata, ...],
                      *, attn_backend: str = "auto", mesh=None,
                      cos_sin: tuple[jax.Array, jax.Array] | None = None, lora: LoRAWeights | None = None,
                      lora_rows: LoRARows | None = None) -> tuple[jax.Array, KVCache]:
        """The decoder layers over a flat ragged batch, before the final norm.

        input_ids: int32 [num_tokens]; padding tokens carry slot -1 in metadata.slot_mapping.
        positions: int32 [num_tokens], each token's position in its sequence.
        kv_cache: pages of every layer, in kv_cache.layout.
        metadata: one AttentionMetadata, whose page table every layer reads (kv_cache: a page array per
            layer); or a tuple of them, one per KV group (models/kv_groups.py: kv_groups(config)), the
            same but for their page tables and slot mappings (kv_cache: a page array per group slot).
        mesh: the jax.sharding.Mesh the parameters and pages are split over, or None (one device).
        cos_sin: rope.cos_sin(positions, rope.inv_freq(config)), float32 [num_tokens, num_slots * head_dim // 2]
            each, where the caller has them (the engine makes them on the host); else computed here.
            Computed in the program, XLA fuses them into every layer's rotary op and so evaluates cos and
            sin again for every layer and head: 34 ms of a 1,024-token step on the CPU.
        lora: the adapters' slots (models/lora.py), with lora_rows which of them each row runs with; None,
            and the model is the base model alone, its program unchanged.
        Returns the last layer's output [num_tokens, hidden] and the cache holding this step's K/V.
        """
        cos, sin = cos_sin if cos_sin is not None else rope.cos_sin(positions, rope.inv_freq(self.config))
        x = self.embed_tokens(input_ids)
        if isinstance(metadata, AttentionMetadata):  # one group: a page array per layer
            slots = [(0, i) for i in range(self.config.num_layers)]
            metadata = (metadata,)
        else:
            groups = kv_groups(self.config)
            slots = [groups.slot(i) for i in range(self.config.num_layers)]
        if len(metadata) != len({g for g, _ in slots}) or len(kv_cache.k) != len({t for _, t in slots}):
            raise ValueError(f"{len(metadata)} page tables and {len(kv_cache.k)} page arrays do not fit this "
                             f"model's KV groups ({len(self.layers)} layers)")
        ks, vs = list(kv_cache.k), list(kv_cache.v)
        adapters = lora.for_step(lora_rows, x.dtype) if lora is not None else (None,) * len(self.layers)
        for layer, (g, t), adapter in zip(self.layers, slots, adapters, strict=True):
            x, ks[t], vs[t] = _decoder_layer(*nnx.split(layer), x, cos, sin, ks[t], vs[t], metadata[g], adapter,
                                             attn_backend=attn_backend, kv_layout=kv_cache.layout, mesh=mesh)
        return x, dataclasses.replace(kv_cache, k=tuple(ks), v=tuple(vs))

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        """input_ids: int32 [num_tokens] -> [num_tokens, hidden] in the parameters' dtype."""
        if self.packed and self.config.tie_word_embeddings:  # the embedding's transpose, packed
            x = self.embed[...][input_ids // cpu_kernel.PANEL, :, input_ids % cpu_kernel.PANEL]
        else:
            x = self.embed[...][input_ids]
        if self.scale_embeddings:
            # sqrt(hidden) rounded to the weights' dtype first, as transformers does (55.5, not 55.43, in bfloat16).
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), jnp.float32).astype(x.dtype)
        return x

    def logits(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """x: [rows, hidden], rows of `hidden_states` -> float32 [rows, vocab]: the final norm, the lm_head,
        and the soft cap cap * tanh(logits / cap) where the config sets one (Gemma 2 and 3).

        num_rows: int32 [], how many leading rows are wanted, or None (all). Where the lm_head is
        packed for the C++ matmul only those are multiplied and the padding rows' logits are zeros: at
        Gemma 3's 262,144 columns a row of the lm_head costs about as much as a token of all its layers."""
        x = self.norm(x)
        if self.packed:
            if self.lm_head_int8 is not None:
                lm_head = self.lm_head_int8
            else:
                lm_head = self.embed if self.config.tie_word_embeddings else self.lm_head
            logits = layers.linear(x, lm_head[...], (self.config.vocab_size,), packed=True, rows=num_rows)
        elif self.config.tie_word_embeddings:
            logits = jnp.einsum("th,vh->tv", x, self.embed[...], preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("th,hv->tv", x, self.lm_head[...], preferred_element_type=jnp.float32)
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    @property
    def greedy_head(self) -> bool:
        """Whether greedy_tokens gives the argmax of `logits`: where the lm_head is packed float32 for the
        C++ matmul and not soft-capped (cap * tanh(l / cap) can round two logits to one value, whose
        argmax is then the first of the two, not the larger)."""
        return self.packed and self.lm_head_int8 is None and self.config.final_logit_softcapping is None

    def greedy_tokens(self, x: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        """int32 [rows]: jnp.argmax(self.logits(x, num_rows), axis=-1), the same tokens (ties to the first),
        by one C++ call that keeps each row's running maximum over the lm_head's columns and never writes
        the float32 [rows, vocab] logits (kernels_pallas/cpu/linear.cc: ArgmaxLinearF32). Only where
        greedy_head; x and num_rows as logits'."""
        lm_head = self.embed if self.config.tie_word_embeddings else self.lm_head
        with jax.named_scope("matmul"):
            return cpu_kernel.argmax_linear_cpu(self.norm(x), lm_head[...], self.config.vocab_size, num_rows)

    def pack_for_cpu(self, quantization: str | None = None, onednn_rows: int = 0) -> "DecoderLM":
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
        packer = cpu_kernel.pack_int8 if quantization == "int8" else cpu_kernel.pack_columns
        for layer in model.layers:
            packing = [(layer.attn, ("qkv", "o"))]
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.pack(packer)  # expert by expert, never through oneDNN
            else:
                packing.append((layer.mlp, ("gate_up", "down")))
            for module, names in packing:
                for name in names:
                    weight = getattr(module, name)
                    if onednn_rows:
                        setattr(module, f"{name}_panels", nnx.Param(cpu_kernel.pack_panels(
                            weight[...].reshape(weight.shape[0], -1))))
                    layers.pack(weight, weight[...], packer)
                module.packed, module.onednn_rows = True, onednn_rows
        if quantization == "int8":
            head = model.embed[...].T if model.config.tie_word_embeddings else model.lm_head[...]
            model.lm_head_int8 = nnx.Param(cpu_kernel.pack_int8(head))
        if model.config.tie_word_embeddings:
            layers.pack(model.embed, model.embed[...].T)
        else:
            layers.pack(model.lm_head, model.lm_head[...])
        model.packed = True
        return model
