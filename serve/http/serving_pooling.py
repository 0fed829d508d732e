"""The pooling routes of a --runner pooling server: POST /v1/embeddings, /pooling, /score, /v1/score,
/rerank and /v1/rerank. Prompts are tokenized here and pooled by the engine core (the "pool" call)."""

from __future__ import annotations

import asyncio
import base64
import functools
import time
import uuid
from typing import Any

import numpy as np
from fastapi import APIRouter

from serve.core.pooling.config import PoolingSpec, engine_pooling_spec
from serve.core.pooling.scoring import pair_up, score_inputs, scores_from
from serve.core.pooling.vectors import finish_embeddings, sigmoid
from serve.engine.core_client import EngineDeadError
from serve.http.errors import dead
from serve.http.openai_protocol import OpenAIError
from serve.http.pooling_protocol import EmbeddingRequest, PoolingInput, RerankRequest, ScoreRequest
from serve.http.serving_base import OpenAIServing


class ServingPooling(OpenAIServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])
        router.add_api_route("/pooling", self.pooling, methods=["POST"])
        for path in ("/score", "/v1/score"):
            router.add_api_route(path, self.score, methods=["POST"])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            router.add_api_route(path, self.rerank, methods=["POST"])
        return router

    @functools.cached_property
    def spec(self) -> PoolingSpec | None:
        """The served task and pooler (None on a generate server)."""
        args = self.engine.args
        return (
            engine_pooling_spec(args.model, args.convert, args.pooler_config)[0] if args.runner == "pooling" else None
        )

    def _task(self, model: str | None, route: str, tasks: tuple[str, ...]) -> PoolingSpec:
        """The spec, after the model check; a 400 when this server cannot serve `route` (or a LoRA adapter)."""
        if self.check_model(model) is not None:
            raise OpenAIError(400, f"{route} runs the base model: LoRA adapters serve generation only", param="model")
        if self.spec is None:
            raise OpenAIError(400, f"{route} needs a pooling model: start the server with --runner pooling")
        if self.spec.task not in tasks:
            raise OpenAIError(400, f"{route} is not served for a {self.spec.task} model (--convert {tasks[0]})")
        return self.spec

    def _prompts(self, raw: PoolingInput, add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each input (a 400 naming `input` when one is empty, bad or too long)."""
        items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items:
            raise OpenAIError(400, "input must not be empty", param="input")
        limit = self.engine.max_model_len
        prompts = []
        for item in items:
            try:
                ids = self.engine.input_processor.tokenize(item, add_special_tokens)
            except ValueError as e:
                raise OpenAIError(400, str(e), param="input") from e
            if len(ids) > limit:
                raise OpenAIError(
                    400,
                    f"This model's maximum context length is {limit} tokens; an input has {len(ids)}",
                    param="input",
                )
            prompts.append(ids)
        return prompts

    async def _pool(self, prompts: list[list[int]]) -> np.ndarray:
        try:
            return np.asarray(await self.engine.call("pool", prompts), np.float32)
        except EngineDeadError as e:
            raise dead(e) from e
        except RuntimeError as e:  # the core's error, as "<exception type>: <message>"
            raise OpenAIError(400, str(e).partition(": ")[2] or str(e), param="input") from e

    def _body(self, prefix: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.state.model_name,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }

    async def _embed(self, req: EmbeddingRequest, route: str) -> tuple[np.ndarray, int, PoolingSpec]:
        spec = self._task(req.model, route, ("embed",) if route == "/v1/embeddings" else ("embed", "classify"))
        req.warn_unknown()
        prompts = await asyncio.to_thread(self._prompts, req.input, req.add_special_tokens)
        raw = await self._pool(prompts)
        tokens = sum(map(len, prompts))
        if spec.task == "classify":
            return (sigmoid(raw) if raw.shape[-1] == 1 else _softmax(raw)), tokens, spec
        try:
            return finish_embeddings(raw, spec.pooler.normalize, req.dimensions), tokens, spec
        except ValueError as e:
            raise OpenAIError(400, str(e), param="dimensions") from e

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        vectors, tokens, _ = await self._embed(req, "/v1/embeddings")
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        return self._body("embd", data, tokens)

    async def pooling(self, req: EmbeddingRequest) -> dict[str, Any]:
        vectors, tokens, _ = await self._embed(req, "/pooling")
        data = [
            {"object": "pooling", "index": i, "data": _encode(v, req.encoding_format)} for i, v in enumerate(vectors)
        ]
        return self._body("pool", data, tokens)

    async def _scores(self, model: str | None, route: str, text_1: Any, text_2: Any) -> tuple[list[float], int]:
        spec = self._task(model, route, ("classify", "embed"))
        tok = self.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this model has no tokenizer", param="model")
        try:
            pairs = pair_up(text_1, text_2)
            prompts = await asyncio.to_thread(score_inputs, tok, spec.task, pairs)
        except ValueError as e:
            raise OpenAIError(400, str(e), param=str(e).split(" ")[0]) from e
        self._prompts(prompts)  # the same length and emptiness checks as embeddings
        try:
            return scores_from(spec.task, (await self._pool(prompts)).tolist()), sum(map(len, prompts))
        except ValueError as e:
            raise OpenAIError(400, str(e), param="model") from e

    async def score(self, req: ScoreRequest) -> dict[str, Any]:
        req.warn_unknown()
        scores, tokens = await self._scores(req.model, "/score", req.text_1, req.text_2)
        return self._body("score", [{"object": "score", "index": i, "score": s} for i, s in enumerate(scores)], tokens)

    async def rerank(self, req: RerankRequest) -> dict[str, Any]:
        req.warn_unknown()
        scores, tokens = await self._scores(req.model, "/rerank", req.query, req.documents)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.state.model_name,
            "usage": {"total_tokens": tokens},
            "results": [
                {"index": i, "document": {"text": req.documents[i]}, "relevance_score": scores[i]} for i in order
            ],
        }


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A vector as floats, or OpenAI's base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)
