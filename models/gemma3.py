"""Gemma 3 (text; Gemma3ForCausalLM), and Gemma 2, over the shared layers: what they change from Llama.

- Norms in Gemma's (1 + w) form (layers.RMSNorm unit_offset), before and after both attention and the
  MLP: x + post_norm(attn(pre_norm(x))), then the same around the MLP.
- q/k norms (config.qk_norm), and the attention scale query_pre_attn_scalar**-0.5.
- Layers alternate sliding-window and full attention (config.layer_types: five sliding to one full);
  sliding layers rotate at their own base (config.rope_local_theta, 10,000), full ones at the config's
  base and scaling (rope.slot picks the frequency set).
- A GeGLU MLP (config.hidden_act "gelu_pytorch_tanh"), embeddings scaled by sqrt(hidden), tied
  embeddings, and the final logits soft-capped where the config sets final_logit_softcapping.

Gemma 2 is the same stack without q/k norms, every second layer sliding, one rotary base, and its
attention scores soft-capped too (config.attn_logit_softcapping, which every attention backend applies).
"""

import functools

from flax import nnx

from kernels_pallas import AttentionMetadata
from models import rope
from models.config import ModelConfig
from models.decoder import DecoderLM
from models.layers import MLP, Attention, RMSNorm


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
        """index: the layer's place in the stack, which says its window and rotary frequencies."""
        norm = functools.partial(RMSNorm, config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs,
                                 unit_offset=True)
        self.input_norm = norm()
        self.attn = Attention(config, dtype=dtype, rngs=rngs, window=config.window(index),
                              rope_slot=rope.slot(config, index), unit_offset_norms=True)
        self.post_attention_norm = norm()
        self.pre_mlp_norm = norm()
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)
        self.post_mlp_norm = norm()

    def __call__(self, x, cos, sin, k_pages, v_pages, metadata: AttentionMetadata, attn_backend: str,
                 kv_layout: str, mesh=None, lora=None):
        """x: [num_tokens, hidden]; the rest as Attention.__call__ takes them (lora: this layer's
        lora.LayerLoRA or None, for the attention and the MLP). Returns (x, k_pages, v_pages)."""
        attn, k_pages, v_pages = self.attn(self.input_norm(x), cos, sin, k_pages, v_pages, metadata, attn_backend,
                                           kv_layout, mesh, lora)
        x = x + self.post_attention_norm(attn)
        mlp = self.mlp(self.pre_mlp_norm(x), metadata.query_start_loc[-1], lora)
        return x + self.post_mlp_norm(mlp), k_pages, v_pages


class Gemma3ForCausalLM(DecoderLM):
    layer_class = DecoderLayer
    unit_offset_norms = True
    scale_embeddings = True
