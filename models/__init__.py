"""Llama-family models for the engine: config, flax.nnx model with its jittable step, weight loading."""

from models.config import ARCHITECTURES, Llama3RopeScaling, ModelConfig
from models.llama import TP_AXIS, LlamaForCausalLM, make_forward, pack_for_cpu
from models.loader import DEFAULT_MODEL, MODELS, LoadedModel, load_model, load_tokenizer

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_MODEL",
    "MODELS",
    "Llama3RopeScaling",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "TP_AXIS",
    "load_model",
    "load_tokenizer",
    "make_forward",
    "pack_for_cpu",
]
