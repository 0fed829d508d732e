"""POST /update_weights_from_disk (SGLang's route): an RL trainer hands the running server new weights
from a checkpoint folder, between rollouts. Operators only (the --api-key, or a tenant marked
operator); refused with 409 while requests are in flight, so no answer mixes two sets of weights."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from serve.engine.async_engine import EngineDeadError
from serve.http.errors import dead
from serve.http.openai_protocol import OpenAIError
from serve.http.serving_base import OpenAIServing


class ServingWeights(OpenAIServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/update_weights_from_disk", self.update_from_disk, methods=["POST"])
        return router

    async def update_from_disk(self, request: Request) -> dict[str, Any]:
        tenant = getattr(request.state, "tenant", None)
        if tenant is not None and not tenant.operator:
            raise OpenAIError(403, "updating the weights needs an operator's key", type_="permission_error")
        try:
            body = await request.json()
        except ValueError as e:
            raise OpenAIError(400, f"the body must be JSON: {e}") from e
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise OpenAIError(400, "model_path must be a non-empty string: a checkpoint folder", param="model_path")
        try:
            await self.engine.call("update_weights_from_disk", path)
        except EngineDeadError as e:
            raise dead(e) from e
        except RuntimeError as e:  # the core's error, as "<exception type>: <message>"
            kind, _, message = str(e).partition(": ")
            raise OpenAIError(409 if kind == "EngineBusy" else 400, message or str(e), param="model_path") from e
        return {"success": True, "model_path": path}
