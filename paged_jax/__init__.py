"""paged-jax: continuous batching over a paged KV cache, in JAX.

    from paged_jax import LLM, SamplingParams
    outputs = LLM(model="smollm2-135m").generate(["Hello"], SamplingParams(max_tokens=32))

The engine classes load lazily, so `import paged_jax.core.block_pool` stays light for researchers.
"""

import importlib
import logging

from paged_jax import siblings

# Before anything imports them: `models` and `kernels_pallas` are the project's, whatever folders or
# files of those names lie where the user works (siblings.py).
siblings.install()

# The tokenizers come from transformers, whose first import advises "PyTorch was not found. Models won't
# be available ..." on stderr: true, and irrelevant to an engine that runs its models in JAX, yet it reads
# like a broken install. Only that message is dropped (transformers is imported later, when a tokenizer
# loads); its other warnings still show.
logging.getLogger("transformers").addFilter(lambda record: not record.getMessage().startswith("PyTorch was not"))

_EXPORTS = {
    "LLM": "paged_jax.core.llm",
    "LLMEngine": "paged_jax.core.engine",
    "AsyncLLMEngine": "paged_jax.serving.async_engine",
    "AsyncLLM": "paged_jax.serving.async_engine",
    "EngineConfig": "paged_jax.core.config",
    "SamplingParams": "paged_jax.core.sampling_params",
    "StructuredOutputsParams": "paged_jax.core.sampling_params",
    "RequestOutputKind": "paged_jax.core.sampling_params",
    "RequestOutput": "paged_jax.core.outputs",
    "CompletionOutput": "paged_jax.core.outputs",
    "LoRARequest": "paged_jax.core.lora_request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
