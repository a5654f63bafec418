"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine.

    app = build_app(LLMEngine.from_pretrained("smollm2-135m"), ServerConfig(served_model_name="smollm2-135m"))

POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /health, /ready,
/metrics, /version, guardrails.py's /dashboard, and lora_modules.py's runtime adapter routes. The
engine loop starts with the app (its lifespan) and stops with it; it warms up first (core/warmup.py):
/health answers 200 while the loop runs (liveness), /ready once the warm-up is done (readiness), and
requests sent sooner wait for it. Every error answers with OpenAI's error body, so the official client
raises its typed exceptions.
"""

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
from collections.abc import Awaitable

from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from paged_jax.serving.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from paged_jax.serving.dashboard import PATHS as DASHBOARD_PATHS
from paged_jax.serving.guardrails import add_guardrails
from paged_jax.core.engine import LLMEngine
from paged_jax.serving.kv_events import KVEventDrain, KVEventsConfig
from paged_jax.serving.lora_modules import LoRAModulePath, LoRAModules, add_runtime_routes, runtime_updating_allowed
from paged_jax.serving.metrics import PrometheusMetrics
from paged_jax.serving.middleware import ApiKey, BodyLimit
from paged_jax.serving.openai_protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                               CompletionResponse, ErrorResponse, ModelList, VersionResponse)
from paged_jax.serving.tokenize_protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                 TokenizeResponse)
from paged_jax.serving.openai_serving import APIError, EventStream, OpenAIServing
from paged_jax.serving.tool_parsers import PARSERS

log = logging.getLogger(__name__)

try:
    VERSION = importlib.metadata.version("paged-jax")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    served_model_name: str
    model: str = ""  # what was loaded (a short name or a path), shown by /v1/models
    api_key: str | None = None
    max_num_queued_reqs: int | None = None  # waiting requests beyond which new ones get 429
    request_timeout: float | None = None  # seconds; each request may ask for less
    max_tokens_cap: int | None = None  # the most tokens one request may ask for
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    slo_ttft_ms: float | None = None  # time to first token objective (slo.py)
    slo_tpot_ms: float | None = None  # time per output token objective
    max_queue_time: float | None = None  # seconds a request may wait for admission, then 503
    breaker_threshold: int = 3  # consecutive failed steps that open the circuit breaker
    # tool_choice "auto": the model's calls are read with this tool_parsers.PARSERS format.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    kv_events: KVEventsConfig | None = None  # vLLM's --kv-events-config (kv_events.py)
    # LoRA adapters served from the start (vLLM's --lora-modules), and whether they may come and go at
    # run time (or the environment's VLLM_ALLOW_RUNTIME_LORA_UPDATING says so; lora_modules.py).
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False
    chat_template: str | None = None  # Jinja text chats are rendered with (None: the tokenizer's own)

    def __post_init__(self):
        for name in ("max_num_queued_reqs", "request_timeout", "max_tokens_cap", "max_request_bytes", "slo_ttft_ms",
                     "slo_tpot_ms", "max_queue_time", "breaker_threshold"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The app over `engine`; its lifespan runs the engine loop (AsyncLLMEngine) around the serving."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    metrics = PrometheusMetrics(
        registry, config.served_model_name, max_model_len=engine.resolved.max_model_len,
        cache_config={"block_size": str(engine.resolved.block_size), "num_gpu_blocks": str(engine.resolved.num_blocks - 1),
                      "enable_prefix_caching": str(engine.config.enable_prefix_caching),
                      "cache_dtype": engine.resolved.kv_cache_dtype},
        attention_backend=engine.resolved.attention_backend,
        max_loras=engine.config.max_loras if engine.adapters is not None else None)
    models = LoRAModules(engine, config.served_model_name, config.model or config.served_model_name, config.lora_modules)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        kv_events = KVEventDrain.start(engine, config.kv_events)
        async_engine = AsyncLLMEngine(engine, max_num_queued_reqs=config.max_num_queued_reqs,
                                      max_queue_time=config.max_queue_time,
                                      probe_prefill=config.slo_ttft_ms is not None,
                                      stat_loggers=[metrics, *guardrails.stat_loggers, *filter(None, [kv_events])])
        guardrails.bind(async_engine)
        app.state.engine = async_engine
        app.state.serving = OpenAIServing(
            async_engine, models, max_tokens_cap=config.max_tokens_cap,
            request_timeout=config.request_timeout, guard=guardrails.guard,
            auto_tool_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
            chat_template=config.chat_template)
        try:
            yield
        finally:
            # Run after uvicorn's grace period: whatever still runs ends with finish_reason "abort".
            await asyncio.to_thread(async_engine.shutdown)
            if kv_events is not None:
                kv_events.close()

    app = FastAPI(title="paged-jax", version=VERSION, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions over the paged-jax engine.")
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, on_reject=lambda: metrics.reject("body_too_large"))
    guardrails = add_guardrails(app, registry, config, metrics)
    protected = []
    if config.api_key:
        # Checked first, before a body is read; the dependency only documents the scheme in /openapi.json.
        app.add_middleware(ApiKey, key=config.api_key, passed=DASHBOARD_PATHS, on_reject=lambda: metrics.reject("unauthorized"))
        protected = [Security(HTTPBearer(auto_error=False, description="the server's --api-key"))]
    _add_error_handlers(app, metrics)
    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 429, 500, 503)}
    # OpenAPI 3.1 has a text/event-stream schema describe one event.
    streamed = {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "description": "one server-sent event (with stream: true)",
        "properties": {"data": {"type": "string", "description": "a chunk as JSON (the endpoint's response "
                                                                 "object, or an error); the last event is [DONE]"}}}}}

    @app.post("/v1/completions", response_model=CompletionResponse, dependencies=protected,
              responses=errors | {200: {"content": streamed}})
    async def create_completion(body: CompletionRequest, request: Request):
        return await _answer(request, request.app.state.serving.create_completion(body))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, dependencies=protected,
              responses=errors | {200: {"content": streamed}})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await _answer(request, request.app.state.serving.create_chat_completion(body))

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=protected, responses=errors)
    async def tokenize(body: TokenizeRequest, request: Request):
        return await _answer(request, _now(request.app.state.serving.tokenize, body))

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=protected, responses=errors)
    async def detokenize(body: DetokenizeRequest, request: Request):
        return await _answer(request, _now(request.app.state.serving.detokenize, body))

    @app.get("/v1/models", response_model=ModelList, dependencies=protected, responses=errors)
    async def list_models():
        return ModelList(data=models.cards(engine.resolved.max_model_len))

    if runtime_updating_allowed(config.allow_runtime_lora_updating):
        add_runtime_routes(app, models, protected, errors)

    probe = {200: {"description": "yes (an empty body)"}, 503: {"model": ErrorResponse}}

    @app.get("/health", response_class=Response, responses=probe, summary="Liveness: the engine loop runs")
    async def health(request: Request):
        return _probe(request.app.state.engine.is_running, "the engine loop is not running", "engine_dead")

    @app.get("/ready", response_class=Response, responses=probe,
             summary="Readiness: warmed up, so that no request meets a compile")
    async def ready(request: Request):
        engine = request.app.state.engine
        # The breaker speaks for a dead loop too (it opens then); a live one must have warmed up.
        await guardrails.breaker.check_ready()
        return _probe(engine.is_ready, "warming up: compiling the engine's step shapes" if engine.is_running
                      else "the engine loop is not running", "warming_up" if engine.is_running else "engine_dead")

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=VERSION)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose requests are ended however the response ends: finished, failed, or
    cancelled because the client left (even before the first event, when the events never start)."""

    def __init__(self, stream: EventStream):
        super().__init__(stream.events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


async def _now(fn, *args):
    return fn(*args)


def _probe(ok: bool, why: str, code: str) -> Response:
    if not ok:
        raise APIError(503, why, type="server_error", code=code)
    return Response(status_code=200)


async def _answer(request: Request, work: Awaitable):
    """Run a request's work. If the client disconnects first, cancel it, which aborts its engine
    requests at once rather than when they finish. An unexpected failure is this request's 500 alone
    (answered here: past the app's own handlers, Starlette would close the connection instead)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    try:
        result = task.result()
    except _HANDLED:
        raise
    except Exception as e:
        log.exception("%s %s failed", request.method, request.url.path)
        raise APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error") from e
    if isinstance(result, EventStream):
        return EventStreamResponse(result)
    return JSONResponse(result.model_dump(mode="json"))


async def _disconnected(request: Request) -> None:
    # The body has been read by now, so the next message is the disconnect, whenever it comes.
    while (await request.receive())["type"] != "http.disconnect":
        pass


_HANDLED = (APIError, RequestValidationError, QueueFullError, EngineDeadError, StarletteHTTPException)


def _add_error_handlers(app: FastAPI, metrics: PrometheusMetrics) -> None:
    def answer(error: APIError) -> JSONResponse:
        if error.cause is not None:
            metrics.reject(error.cause)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return answer(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return answer(_validation_error(error))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, error: QueueFullError):
        return answer(APIError(429, str(error), type="rate_limit_error", code="queue_full", cause="queue_full",
                               headers={"Retry-After": str(max(1, round(error.retry_after)))}))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError):
        return answer(APIError(503, str(error), type="server_error", code="engine_dead"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return answer(APIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404
                               else None))

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return answer(APIError(500, f"internal error: {type(error).__name__}", type="server_error"))


def _validation_error(error: RequestValidationError) -> APIError:
    """One 400 listing what pydantic found, with the first offending parameter named."""
    problems, params = [], []
    for e in error.errors():
        where = [str(part) for part in e["loc"] if part != "body"]
        if e["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
            continue
        if not where and e["type"] == "model_attributes_type":
            problems.append("the body must be a JSON object (and the Content-Type application/json)")
            continue
        param = (e.get("ctx") or {}).get("param") or (where[0] if where else None)
        params.append(param)
        problems.append(f"{'.'.join(where)}: {e['msg']}" if where else e["msg"])
    code = "unsupported_parameter" if any(e["type"] in ("unsupported_parameter", "extra_forbidden")
                                          for e in error.errors()) else "invalid_value"
    return APIError(400, "; ".join(problems) or "invalid request", param=params[0] if params else None, code=code,
                    cause="bad_params")
