"""An OpenAI-compatible gateway over paged-jax replicas: LiteLLM's Router (weighted deployments, retries
on another replica, cooldowns after 429s and 5xx, fallback groups) run in-process from a LiteLLM proxy
config, behind a small FastAPI app.

    python examples/fleet/gateway.py --config examples/fleet/litellm_config.yaml --port 4000

The same config runs LiteLLM's own proxy (`litellm --config ...`, from `pip install 'litellm[proxy]'`),
which does the same routing with keys, budgets and a database around it; its proxy extra needs
packages this project does not install (docs/scaling.md says why). This gateway answers completions and
chat completions, streamed (server-sent events, as OpenAI sends them) or not, and says which deployment
answered in the headers the proxy uses: x-litellm-model-id and x-litellm-model-api-base. A stream is
retried on another replica only until its first chunk: one that breaks later ends early.
"""

import argparse
import os

# LiteLLM fetches its model price list from the network at import; its packaged copy serves here.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
import uvicorn  # noqa: E402
import yaml  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402


def make_router(config: dict) -> litellm.Router:
    """The Router a LiteLLM proxy config describes: its model_list and its router_settings."""
    return litellm.Router(model_list=config["model_list"], **config.get("router_settings", {}))


def build_app(router: litellm.Router) -> FastAPI:
    app = FastAPI(title="paged-jax fleet gateway")

    async def forward(call, request: Request) -> JSONResponse:
        body = await request.json()
        try:
            response = await call(**body)
        except Exception as e:  # LiteLLM's errors carry the status the last deployment (or LiteLLM) gave
            return _error(getattr(e, "status_code", 500), str(e), type(e).__name__)
        hidden = getattr(response, "_hidden_params", {}) or {}
        headers = {"x-litellm-model-id": str(hidden.get("model_id")),
                   "x-litellm-model-api-base": str(hidden.get("api_base"))}
        if body.get("stream"):
            return StreamingResponse(_events(response), media_type="text/event-stream", headers=headers)
        return JSONResponse(response.model_dump(exclude_none=True), headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward(router.acompletion, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(router.atext_completion, request)

    @app.get("/v1/models")
    async def models():
        names = sorted({d["model_name"] for d in router.model_list})
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "paged-jax"} for n in names]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


async def _events(stream):
    """LiteLLM's stream of chunks as server-sent events, ending with OpenAI's [DONE]."""
    async for chunk in stream:
        yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
    yield "data: [DONE]\n\n"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "litellm_config.yaml"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4000)
    args = p.parse_args(argv)
    with open(args.config) as f:
        router = make_router(yaml.safe_load(f))
    uvicorn.run(build_app(router), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
