"""Llama-family models for the engine: config, flax.nnx model with its jittable step, weight loading;
registry.py names the architectures."""

from models.config import Llama3RopeScaling, ModelConfig
from models.llama import TP_AXIS, LlamaForCausalLM
from models.loader import DEFAULT_MODEL, MODELS, LoadedModel, load_model, load_tokenizer
from models.registry import ARCHITECTURES, Architecture, architecture

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "DEFAULT_MODEL",
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
