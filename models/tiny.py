"""Tiny random models without torch or a checkpoint: for lowering tests and the GPU check."""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.registry import architecture

# Group 3 (as SmolLM2's 9 heads over 3), which the Pallas kernel pads to 4; head_dim 16, the
# smallest its Triton tiles take.
TINY_LLAMA = ModelConfig(
    architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
)

# Gemma 3's features in small, for the same uses: q/k norms, a window of 8 on the sliding layers around a
# full one (each kind with its rotary base), GeGLU, the attention scale, a logit cap; 2 KV heads to split.
TINY_GEMMA3 = ModelConfig(
    architecture="gemma3_text", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512,
    tie_word_embeddings=True, sliding_window=8, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    qk_norm=True, hidden_act="gelu_pytorch_tanh", rope_local_theta=1e4, query_pre_attn_scalar=24,
    final_logit_softcapping=5.0,
)


def random_model(config: ModelConfig = TINY_LLAMA, *, dtype=jnp.float32, seed: int = 0) -> nnx.Module:
    """A model of config's architecture with every weight random, made on the default device.

    Norm weights are uniform in [0.5, 1.5] and the others normal(0, 0.15), as the tests' transformers
    checkpoints are: the logits spread wide enough that greedy tokens rarely sit on a near-tie, so two
    attention backends can be compared token for token.
    """
    model = architecture(config.architecture).model_class(config, dtype=dtype, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def draw(path, x, key):
        if "norm" in jax.tree_util.keystr(path):
            return jax.random.uniform(key, x.shape, jnp.float32, 0.5, 1.5).astype(x.dtype)
        return (0.15 * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)

    nnx.update(model, jax.tree_util.tree_unflatten(tree, [draw(p, x, k) for (p, x), k in zip(leaves, keys)]))
    return model

# Qwen3-MoE in small, for the same uses: 8 experts, top 2 renormalised, a dense layer between two sparse
# ones; experts 32 wide and the dense MLP 96, both split evenly over 2 or 4 devices.
TINY_QWEN3_MOE = ModelConfig(
    architecture="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=512, qk_norm=True,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(1,),
)
