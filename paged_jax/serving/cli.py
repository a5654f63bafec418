"""Serve a model over the OpenAI-compatible API (server.py) with uvicorn.

    python -m paged_jax.serve --model smollm2-135m          # http://127.0.0.1:8000/v1
    paged-jax-serve --model smollm2-135m --port 8001 --api-key KEY --max-num-queued-reqs 64

Engine options take vLLM's flag names (--max-num-seqs, --block-size, --no-enable-prefix-caching, ...).
SIGINT or SIGTERM stops accepting connections, lets running requests finish for --shutdown-timeout
seconds, ends the rest with finish_reason "abort", and exits 0.

On many hosts (docs/scaling.md), every process runs the same command with its --process-id; process 0
serves, the others follow its steps.
"""

import argparse
import dataclasses
import logging
import os
import signal
import typing

import uvicorn

import models
from kernels_pallas import BACKENDS, LAYOUTS
from paged_jax.core import distributed
from paged_jax.core.config import DTYPES, KV_CACHE_DTYPES, MATMUL_BACKENDS, EngineConfig
from paged_jax.core.engine import LLMEngine
from paged_jax.serving.server import DEFAULT_MAX_REQUEST_BYTES, ServerConfig, build_app

API_KEY_ENV = "PAGED_JAX_API_KEY"

# EngineConfig fields whose vLLM flag is not the field's name.
_FLAG_NAMES = {"num_blocks": "num-gpu-blocks-override"}
_CHOICES = {"dtype": DTYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "quantization": ("int8",), "attention_backend": BACKENDS, "matmul_backend": MATMUL_BACKENDS, "kv_layout": ("auto", *LAYOUTS)}
_HELP = {
    "block_size": "tokens per KV-cache block (default: 64 for the C++ CPU kernel, else 16)",
    "num_blocks": "KV-cache blocks (overrides --kv-cache-memory-bytes)",
    "kv_cache_memory_bytes": "memory for the KV cache",
    "gpu_memory_utilization": "share of GPU memory for weights and KV cache",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step",
    "max_model_len": "context length (default: the model's)",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts over steps, beside decodes",
    "preemption_mode": "how a sequence gives way when the KV cache runs short",
    "scheduling_policy": "who is admitted first and preempted last (priority: lower value first)",
    "dtype": "parameter (and, unless --kv-cache-dtype says otherwise, KV-cache) dtype",
    "kv_cache_dtype": "KV-cache dtype; auto: --dtype's. bfloat16 under float32 weights halves the K/V bytes",
    "attention_backend": "paged-attention implementation",
    "matmul_backend": "the model's matmuls: cpu packs the weights for the C++ kernel, xla leaves them to XLA",
    "kv_layout": "KV page layout: token-major [block, slot, head, dim] or head-major [block, head, slot, dim]; "
                 "auto: head-major for the C++ CPU kernel, else token-major",
    "tensor_parallel_size": "devices to split the model's heads and MLP over (tensor parallelism)",
    "quantization": "int8: the layers' weights in int8, activations quantized per token (the C++ matmul, float32 on one CPU)",
    "seed": "engine seed, for requests without their own",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="short name, GGUF file or Hugging Face folder")
    p.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on the API (default: ${API_KEY_ENV})")
    p.add_argument("--max-num-queued-reqs", type=int, help="waiting requests beyond which new ones get 429")
    p.add_argument("--request-timeout", type=float, help="seconds a request may take (requests may ask for less)")
    p.add_argument("--max-tokens-cap", type=int, help="the most tokens one request may ask for")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="request body limit")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    engine = p.add_argument_group("engine options (vLLM's names)")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + _FLAG_NAMES.get(field.name, field.name.replace("_", "-"))
        if isinstance(field.default, bool):
            engine.add_argument(flag, dest=field.name, default=field.default, action=argparse.BooleanOptionalAction,
                                help=_HELP[field.name])
        else:
            literal = typing.get_args(field.type) if typing.get_origin(field.type) is typing.Literal else None
            engine.add_argument(flag, dest=field.name, default=field.default, choices=_CHOICES.get(field.name, literal),
                                type=str if field.name == "quantization" else
                                int if field.default is None else type(field.default),
                                metavar=flag[2:].upper().replace("-", "_") if field.name in _FLAG_NAMES else None,
                                help=_HELP[field.name] + ("" if field.default is None else " (default: %(default)s)"))
    distributed.add_arguments(p)
    args = p.parse_args(argv)
    try:
        args.engine_config = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
        args.server_config = ServerConfig(
            served_model_name=args.served_model_name or args.model, model=args.model, api_key=args.api_key,
            max_num_queued_reqs=args.max_num_queued_reqs, request_timeout=args.request_timeout,
            max_tokens_cap=args.max_tokens_cap, max_request_bytes=args.max_request_bytes)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    distributed.initialize_from_args(args)
    engine = LLMEngine.from_pretrained(args.model, args.engine_config)
    if distributed.is_follower():
        distributed.follow(engine.runner)
        return 0
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine, args.server_config), host=args.host, port=args.port, log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log, timeout_graceful_shutdown=args.shutdown_timeout))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again so that the process
    # ends the way the signal's previous handler says; with these no-op handlers it returns, and we exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0

