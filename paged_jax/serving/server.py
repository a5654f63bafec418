"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine.

    app = build_app(LLMEngine.from_pretrained("smollm2-135m"), ServerConfig(served_model_name="smollm2-135m"))

POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /health, /metrics,
/version. The engine loop starts with the app (its lifespan) and stops with it. Every error answers
with OpenAI's error body, so the official client raises its typed exceptions.
"""

import asyncio
import contextlib
import dataclasses
import hmac
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
from paged_jax.core.engine import LLMEngine
from paged_jax.serving.metrics import PrometheusMetrics
from paged_jax.serving.openai_protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                       ModelCard, ModelList, TokenizeRequest, TokenizeResponse, VersionResponse)
from paged_jax.serving.openai_serving import APIError, EventStream, OpenAIServing

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

    def __post_init__(self):
        for name in ("max_num_queued_reqs", "request_timeout", "max_tokens_cap", "max_request_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The app over `engine`; its lifespan runs the engine loop (AsyncLLMEngine) around the serving."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    metrics = PrometheusMetrics(
        registry, config.served_model_name, max_model_len=engine.resolved.max_model_len,
        cache_config={"block_size": str(engine.resolved.block_size), "num_gpu_blocks": str(engine.resolved.num_blocks - 1),
                      "enable_prefix_caching": str(engine.config.enable_prefix_caching),
                      "cache_dtype": engine.resolved.kv_cache_dtype},
        attention_backend=engine.resolved.attention_backend)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine = AsyncLLMEngine(engine, max_num_queued_reqs=config.max_num_queued_reqs, stat_loggers=[metrics])
        app.state.engine = async_engine
        app.state.serving = OpenAIServing(async_engine, config.served_model_name, max_tokens_cap=config.max_tokens_cap,
                                          request_timeout=config.request_timeout)
        try:
            yield
        finally:
            # Run after uvicorn's grace period: whatever still runs ends with finish_reason "abort".
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="paged-jax", version=VERSION, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions over the paged-jax engine.")
    app.add_middleware(_BodyLimit, max_bytes=config.max_request_bytes, on_reject=lambda: metrics.reject("body_too_large"))
    protected = []
    if config.api_key:
        # Checked first, before a body is read; the dependency only documents the scheme in /openapi.json.
        app.add_middleware(_ApiKey, key=config.api_key, on_reject=lambda: metrics.reject("unauthorized"))
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
        return ModelList(data=[ModelCard(id=config.served_model_name, root=config.model or config.served_model_name,
                                         max_model_len=engine.resolved.max_model_len)])

    @app.get("/health", response_class=Response,
             responses={200: {"description": "the engine loop runs (an empty body)"}, 503: {"model": ErrorResponse}})
    async def health(request: Request):
        if not request.app.state.engine.is_running:
            raise APIError(503, "the engine loop is not running", type="server_error", code="engine_dead")
        return Response(status_code=200)

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


class _ApiKey:
    """Refuses requests without `Authorization: Bearer <key>` with 401, except on the open paths."""

    OPEN = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})

    def __init__(self, app, key: str, on_reject):
        self.app, self.key, self.on_reject = app, key.encode(), on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        self.on_reject()
        error = APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)


class _BodyLimit:
    """Refuses bodies over max_bytes with 413, before anything parses them (a declared Content-Length
    is refused unread; a chunked body is read up to the limit)."""

    def __init__(self, app, max_bytes: int, on_reject):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        self.on_reject()
        error = APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                         code="request_too_large")
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)
