"""Serve a model over the OpenAI-compatible API (server.py) with uvicorn.

    python -m paged_jax.serve --model smollm2-135m          # http://127.0.0.1:8000/v1
    paged-jax-serve --model smollm2-135m --port 8001 --api-key KEY --max-num-queued-reqs 64
    paged-jax-serve --model smollm2-135m --enable-lora --max-loras 4 --lora-modules sql=/adapters/sql chat=/adapters/chat

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
from paged_jax.core import distributed
from paged_jax.core.config import EngineConfig
from paged_jax.core.engine import LLMEngine
from paged_jax.serving.kv_events import KVEventsConfig
from paged_jax.serving.lora_modules import RUNTIME_UPDATING_ENV, LoRAModulePath
from paged_jax.spec_decode.config import SpeculativeConfig
from paged_jax.serving.server import DEFAULT_MAX_REQUEST_BYTES, ServerConfig, build_app
from paged_jax.serving.tool_parsers import PARSERS

API_KEY_ENV = "PAGED_JAX_API_KEY"

# EngineConfig fields whose vLLM flag is not the field's name; every other flag is the field's name.
_FLAG_NAMES = {"num_blocks": "num-gpu-blocks-override"}


def _add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """A flag per EngineConfig field, with the help and choices the field carries (config._option)."""
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + _FLAG_NAMES.get(field.name, field.name.replace("_", "-"))
        help, choices = field.metadata.get("help", ""), field.metadata.get("choices")
        if field.type is bool:
            group.add_argument(flag, dest=field.name, default=field.default, action=argparse.BooleanOptionalAction,
                               help=help)
            continue
        # `int | None` takes ints; None is the default's, never typed in.
        value_type = next(t for t in typing.get_args(field.type) or (field.type,) if t is not type(None))
        if value_type is SpeculativeConfig:  # given as JSON, vLLM's --speculative-config
            value_type = SpeculativeConfig.of
        group.add_argument(flag, dest=field.name, default=field.default, choices=choices, type=value_type,
                           metavar=flag[2:].upper().replace("-", "_") if field.name in _FLAG_NAMES else None,
                           help=help + ("" if field.default is None else " (default: %(default)s)"))


def read_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM reads it: a file's text, else the value itself if it reads as a template."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if any(c in value for c in "{}\n"):
            return value
        raise ValueError(f"--chat-template {value!r} is neither a template nor a file that opens: {e}") from e


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
    p.add_argument("--slo-ttft-ms", type=float, help="time-to-first-token objective: counted in goodput, and a request "
                   "whose predicted queue wait already exceeds it gets 429")
    p.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token objective, counted in goodput")
    p.add_argument("--max-queue-time", type=float, help="seconds a request may wait for admission, then 503")
    p.add_argument("--breaker-threshold", type=int, default=3, help="consecutive failed engine steps that open the "
                   "circuit breaker: /ready and new requests answer 503 until a step succeeds (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": read the calls the model writes with --tool-call-parser')
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                   help="the format of the model's tool calls: hermes (<tool_call> JSON: Qwen2.5, Hermes) or "
                        "llama3_json (Llama 3.1's JSON)")
    p.add_argument("--kv-events-config", help="vLLM's KV-cache events, as JSON: {\"enable_kv_cache_events\": true, "
                   "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"\", \"replay_endpoint\": ...}")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) to serve under these names, which requests give as their "
                   "model (with --enable-lora); each NAME=PATH or vLLM's JSON "
                   "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help=f"serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as ${RUNTIME_UPDATING_ENV}"
                   "=true does, vLLM's switch)")
    p.add_argument("--chat-template", help="the Jinja template /v1/chat/completions renders conversations with, or a "
                   "file holding it (default: the tokenizer's own; a GGUF's tokenizer.chat_template)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    _add_engine_flags(p.add_argument_group("engine options (vLLM's names)"))
    distributed.add_arguments(p)
    args = p.parse_args(argv)
    try:
        lora_modules = tuple(LoRAModulePath.parse(text) for text in args.lora_modules)
        if lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        args.engine_config = EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
        args.server_config = ServerConfig(
            served_model_name=args.served_model_name or args.model, model=args.model, api_key=args.api_key,
            max_num_queued_reqs=args.max_num_queued_reqs, request_timeout=args.request_timeout,
            max_tokens_cap=args.max_tokens_cap, max_request_bytes=args.max_request_bytes,
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, max_queue_time=args.max_queue_time,
            breaker_threshold=args.breaker_threshold, enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser, chat_template=read_chat_template(args.chat_template),
            kv_events=KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None,
            lora_modules=lora_modules, allow_runtime_lora_updating=args.allow_runtime_lora_updating)
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

