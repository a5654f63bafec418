"""The models the engine runs (the Llama family, Qwen3, Gemma 3, the mixtures of experts Qwen3-MoE and
Mixtral): config, flax.nnx models over shared layers with their jittable step, weight loading;
registry.py names the architectures."""

from models.config import Llama3RopeScaling, ModelConfig
from models.decoder import DecoderLM
from models.gemma3 import Gemma3ForCausalLM
from models.llama import LlamaForCausalLM
from models.sharding import TP_AXIS
from models.loader import DEFAULT_MODEL, MODELS, LoadedModel, load_model, load_tokenizer
from models.registry import ARCHITECTURES, Architecture, architecture

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "DEFAULT_MODEL",
    "DecoderLM",
    "Gemma3ForCausalLM",
    "MODELS",
    "Llama3RopeScaling",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "TP_AXIS",
    "architecture",
    "load_model",
    "load_tokenizer",
]
