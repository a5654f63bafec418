"""The server's LoRA adapters, as vLLM serves them (its OpenAIServingModels): each has a name a request
gives as its `model`, /v1/models lists it with the base model as its `parent`, and, where allowed
(VLLM_ALLOW_RUNTIME_LORA_UPDATING, or --allow-runtime-lora-updating), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter add and remove adapters while the server runs.

Every adapter loaded gets a new LoRARequest id, never reused: an adapter unloaded and loaded again under
its name (from another folder, say) shares no device slot and no prefix-cache block with its former self.
A load reads the folder off the engine's thread (a bad one is a 400 and changes nothing), then hands its
host copy to the engine between two steps; a device slot takes it when a request first runs with it, by
the program compiled at warm-up, so nothing compiles. An unload is refused (400) while a request the
engine holds uses the adapter.
"""

import asyncio
import dataclasses
import itertools
import json
import os

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from paged_jax.core.engine import LLMEngine
from paged_jax.core.engine_stats import waiting_seqs
from paged_jax.core.errors import RequestError
from paged_jax.core.lora_request import LoRARequest
from paged_jax.serving.async_engine import AsyncLLMEngine
from paged_jax.serving.openai_errors import APIError
from paged_jax.serving.openai_protocol import ModelCard

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool = False) -> bool:
    """Whether the load and unload endpoints exist: the flag, or the environment variable vLLM reads."""
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry: `name=path`, or vLLM's JSON {"name": ..., "path": ..., "base_model_name": ...}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
                return cls(str(fields["name"]), str(fields["path"]), fields.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {text!r}: a JSON entry needs \"name\" and \"path\" ({e})") from e
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or JSON")
        return cls(name, path)


def not_found(message: str) -> APIError:
    """vLLM's 404: its type NotFoundError and the status as the code (openai raises NotFoundError)."""
    return APIError(404, message, type="NotFoundError", param="model", code=404, cause="not_found")


def _invalid(message: str) -> APIError:
    return APIError(400, message, type="InvalidUserInput", code=400)


class LoRAModules:
    def __init__(self, engine: LLMEngine, base_name: str, base_root: str, modules: tuple[LoRAModulePath, ...] = ()):
        """The adapters of `modules`, read now (before the engine loop starts; a bad one raises ValueError,
        and the server does not start). base_name and base_root: the base model's id and its path."""
        if modules and engine.adapters is None:
            raise ValueError("--lora-modules needs --enable-lora")
        self.base_name, self.base_root = base_name, base_root
        self._ids = itertools.count(1)
        self.requests: dict[str, LoRARequest] = {}  # by name, in the order loaded
        self._parents: dict[str, str] = {}
        self._lock = asyncio.Lock()
        for module in modules:
            request = self._new(module.name, module.path)
            try:
                engine.adapters.check(request)
            except RequestError as e:
                raise ValueError(str(e)) from e
            self._add(request, module.base_model_name)

    def resolve(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model), or vLLM's 404."""
        if name is None or name == self.base_name:
            return None
        if name in self.requests:
            return self.requests[name]
        raise not_found(f"The model `{name}` does not exist.")

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=self.base_name, root=self.base_root, max_model_len=max_model_len),
                *(ModelCard(id=name, root=r.lora_path, parent=self._parents[name], max_model_len=max_model_len)
                  for name, r in self.requests.items())]

    async def load(self, engine: AsyncLLMEngine, name: str, path: str) -> str:
        """Add adapter `name` from folder `path`: vLLM's success text, or a 400 (nothing changes then)."""
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lock:
            if name in self.requests or name == self.base_name:
                raise _invalid(f"The lora adapter '{name}' has already been loaded.")
            adapters = engine.engine.adapters
            if adapters is None:
                raise _invalid("LoRA adapters are not enabled on this server (--enable-lora)")
            request = self._new(name, path)
            try:
                weights = await asyncio.to_thread(adapters.read, request)
            except RequestError as e:
                raise APIError(400, str(e), type="BadRequestError", code=400) from e
            await engine.call(lambda e: e.adapters.keep(request.lora_int_id, weights))
            self._add(request, self.base_name)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, engine: AsyncLLMEngine, name: str) -> str:
        """Remove adapter `name`: vLLM's success text, a 404 if there is none, a 400 while requests use it."""
        if not name:
            raise _invalid("'lora_name' must be provided.")
        async with self._lock:
            request = self.requests.get(name)
            if request is None:
                raise not_found(f"The lora adapter '{name}' cannot be found.")
            users = await engine.call(lambda e: _remove_unless_used(e, request.lora_int_id))
            if users:
                raise _invalid(f"The lora adapter '{name}' is in use by {users} running or waiting requests; "
                               "unload it once they finish")
            del self.requests[name], self._parents[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _new(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)

    def _add(self, request: LoRARequest, parent: str | None) -> None:
        self.requests[request.lora_name] = request
        self._parents[request.lora_name] = parent or self.base_name


def _remove_unless_used(engine: LLMEngine, lora_int_id: int) -> int:
    """On the engine's thread: how many requests the engine holds use the adapter; it is removed if none."""
    users = {seq.request_id for seq in (*engine.scheduler.running, *waiting_seqs(engine))
             if seq.lora is not None and seq.lora.lora_int_id == lora_int_id}
    if not users:
        engine.adapters.remove(lora_int_id)
    return len(users)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; adapters are named here


def add_runtime_routes(app: FastAPI, models: LoRAModules, dependencies: list, responses: dict) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter; each answers vLLM's text on success."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, dependencies=dependencies,
              responses=responses)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
        return await models.load(request.app.state.engine, body.lora_name, body.lora_path)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, dependencies=dependencies,
              responses=responses)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
        return await models.unload(request.app.state.engine, body.lora_name)
