"""GET /health (and vLLM's GET and POST /ping), /metrics, /v1/models (the base model and its LoRA adapters)
and /version: what is served and whether it is up."""

from __future__ import annotations

import importlib.metadata
import uuid
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from serve.http.serving_base import OpenAIServing


class ServingModels(OpenAIServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/ping", self.health, methods=["GET", "POST"])  # vLLM's (SageMaker's) health check
        router.add_api_route("/metrics", self.metrics, methods=["GET"])
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/version", self.version, methods=["GET"])
        return router

    async def health(self) -> Response:
        if not self.engine.healthy:
            return JSONResponse(
                {"status": "error", "error": self.engine.error or "the engine core is not running"}, status_code=503
            )
        return Response(status_code=200)

    async def metrics(self) -> Response:
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(self) -> dict[str, str]:
        return {"version": importlib.metadata.version("jaxinfra")}

    async def models(self) -> dict[str, Any]:
        """The base model, then each LoRA adapter served (vLLM's cards: root its folder, parent its base)."""
        state = self.state
        cards = [self._card(state.model_name, self.engine.args.model, None)]
        for name, adapter in state.loras.adapters.items():
            cards.append(self._card(name, adapter.request.lora_path, adapter.base_model_name))
        return {"object": "list", "data": cards}

    def _card(self, model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        created = self.state.created
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "jaxinfra",
            "root": root,
            "parent": parent,
            "max_model_len": self.engine.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, model_id).hex}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
