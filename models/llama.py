"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, and the mixtures of experts Qwen3-MoE and
Mixtral): pre-norm layers of attention and a SwiGLU MLP over the shared layers (layers.py). Qwen2's q/k/v
biases, Qwen3's q/k norms and Mistral's sliding window are config fields the shared attention reads, and
a sparse layer (config.sparse) has the mixture of experts of moe.py for its MLP, so none needs a layer of
its own."""

from flax import nnx

from kernels_pallas import AttentionMetadata
from models import rope
from models.config import ModelConfig
from models.decoder import DecoderLM
from models.layers import MLP, Attention, RMSNorm
from models.moe import SparseMoE
from models.sharding import TP_AXIS

__all__ = ["DecoderLayer", "LlamaForCausalLM", "TP_AXIS"]


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, index: int, *, dtype, rngs: nnx.Rngs):
        """index: the layer's place in the stack, which says its window and rotary frequencies."""
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.attn = Attention(config, dtype=dtype, rngs=rngs, window=config.window(index),
                              rope_slot=rope.slot(config, index))
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = (SparseMoE if config.sparse(index) else MLP)(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, k_pages, v_pages, metadata: AttentionMetadata, attn_backend: str,
                 kv_layout: str, mesh=None, lora=None):
        """x: [num_tokens, hidden]; the rest as Attention.__call__ takes them (lora: this layer's
        lora.LayerLoRA or None, for the attention and the MLP). Returns (x, k_pages, v_pages)."""
        attn, k_pages, v_pages = self.attn(self.input_norm(x), cos, sin, k_pages, v_pages, metadata, attn_backend,
                                           kv_layout, mesh, lora)
        x = x + attn
        return x + self.mlp(self.post_attention_norm(x), metadata.query_start_loc[-1], lora), k_pages, v_pages


class LlamaForCausalLM(DecoderLM):
    layer_class = DecoderLayer
