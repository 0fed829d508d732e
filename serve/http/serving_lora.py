"""POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name} (vLLM's routes):
adapters served by name at run time, beside --lora-modules'. Operators only (the --api-key, or a tenant
marked operator). The engine core reads and checks an adapter before its name is served; unloading stops
serving the name at once (new requests get 404), while requests already sent with it finish with it."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from serve.engine.async_engine import EngineDeadError
from serve.http.errors import dead
from serve.http.lora_modules import LoRAModulePath
from serve.http.openai_protocol import OpenAIError
from serve.http.serving_base import OpenAIServing
from serve.http.state import ServerState
from serve.types import LoRARequest


async def load_adapter(state: ServerState, module: LoRAModulePath) -> LoRARequest:
    """Read `module` into the engine core and serve it by name; a 400 with the core's reason if it cannot
    be served (LoRA off, a name taken, not a PEFT LoRA folder, a rank above --max-lora-rank)."""
    if not state.engine.args.enable_lora:
        raise OpenAIError(400, "LoRA adapters need the server started with --enable-lora", param="lora_name")
    try:
        request = state.loras.reserve(module)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="lora_name") from e
    try:
        await state.engine.call("add_lora", request.lora_name, request.lora_int_id, request.lora_path)
    except EngineDeadError as e:
        state.loras.release(request)
        raise dead(e) from e
    except RuntimeError as e:  # the core's error, as "<exception type>: <message>"
        state.loras.release(request)
        raise OpenAIError(400, str(e).partition(": ")[2] or str(e), param="lora_path") from e
    except BaseException:
        state.loras.release(request)
        raise
    state.loras.commit(request, module.base_model_name)
    return request


class ServingLora(OpenAIServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/load_lora_adapter", self.load, methods=["POST"])
        router.add_api_route("/v1/unload_lora_adapter", self.unload, methods=["POST"])
        return router

    async def _body(self, request: Request, fields: tuple[str, ...]) -> list[str]:
        """The named fields of an operator's JSON body, each a non-empty string (a 403 or 400 otherwise)."""
        tenant = getattr(request.state, "tenant", None)
        if tenant is not None and not tenant.operator:
            raise OpenAIError(403, "loading and unloading adapters needs an operator's key", type_="permission_error")
        try:
            body: Any = await request.json()
        except ValueError as e:
            raise OpenAIError(400, f"the body must be JSON: {e}") from e
        values: list[str] = []
        for field in fields:
            value = body.get(field) if isinstance(body, dict) else None
            if not isinstance(value, str) or not value:
                raise OpenAIError(400, f"{field} must be a non-empty string", param=field)
            values.append(value)
        return values

    async def load(self, request: Request) -> PlainTextResponse:
        name, path = await self._body(request, ("lora_name", "lora_path"))
        await load_adapter(self.state, LoRAModulePath(name, path))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> PlainTextResponse:
        (name,) = await self._body(request, ("lora_name",))
        lora = self.state.loras.remove(name)
        if lora is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        with contextlib.suppress(EngineDeadError):  # a new core holds no adapters: the name is gone either way
            await self.engine.call("remove_lora", lora.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
