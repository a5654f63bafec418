"""Where the tensors of Qwen3-MoE and Mixtral Hugging Face checkpoints land in LlamaForCausalLM's state:
Llama's table (llama_weights.py), whose dense MLP then fills only the dense layers, and per sparse layer
its router and each expert's gate, up and down, stacked over experts (models/moe.py)."""

from models.config import ModelConfig
from models.llama_weights import LAYER, RULES, WeightRule, gate_up, transposed


def sparse_layers(c: ModelConfig) -> list[int]:
    return [i for i in range(c.num_layers) if c.sparse(i)]


def _experts(block: str, gate: str, up: str, down: str) -> tuple[WeightRule, ...]:
    """The rules of a sparse layer whose Hugging Face module is `block`, its experts' projections named
    gate, up and down; each [out, in] as torch's Linear holds it."""
    expert = f"{LAYER}{block}.experts.{{e}}."
    mlp = "layers.{i}.mlp."
    moe = dict(layers=sparse_layers)
    return (
        WeightRule(f"{LAYER}{block}.gate.weight", mlp + "router", lambda c: (c.num_experts, c.hidden_size),
                   transposed, **moe),
        WeightRule(f"{expert}{gate}.weight", mlp + "expert_gate_up",
                   lambda c: (c.moe_intermediate_size, c.hidden_size), gate_up(0), **moe),
        WeightRule(f"{expert}{up}.weight", mlp + "expert_gate_up",
                   lambda c: (c.moe_intermediate_size, c.hidden_size), gate_up(1), **moe),
        WeightRule(f"{expert}{down}.weight", mlp + "expert_down",
                   lambda c: (c.hidden_size, c.moe_intermediate_size), transposed, **moe),
    )


QWEN3_MOE = (*RULES, *_experts("mlp", "gate_proj", "up_proj", "down_proj"))
MIXTRAL = (*RULES, *_experts("block_sparse_moe", "w1", "w3", "w2"))  # Mixtral's w1 gate, w3 up, w2 down
