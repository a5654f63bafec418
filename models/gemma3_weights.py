"""Where each tensor of a Gemma 3 Hugging Face checkpoint (Gemma3ForCausalLM) lands in Gemma3ForCausalLM's
state: Llama's table (llama_weights.py) with Gemma's four norms per layer. Hugging Face's
post_attention_layernorm is Gemma's norm of the attention's output, not the MLP's input norm as in Llama."""

from models.llama_weights import ATTENTION_MLP, EMBED_HEAD, LAYER, WeightRule, hidden, whole

_NORMS = {
    "input_layernorm": "input_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "pre_mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}
RULES = (
    *EMBED_HEAD,
    *(WeightRule(f"{LAYER}{hf}.weight", f"layers.{{i}}.{ours}.weight", hidden, whole) for hf, ours in _NORMS.items()),
    *ATTENTION_MLP,
)
