"""The app factory: error handlers, middleware and each serving class's routes over one AsyncEngine.

A new endpoint is a serving class (serving_base.OpenAIServing) added to SERVING_CLASSES; new
middleware is a pure ASGI class added to middleware.MIDDLEWARE.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Mapping, Sequence

from fastapi import FastAPI

from serve.engine.async_engine import AsyncEngine
from serve.http.auth import OPEN_PATHS, AuthMiddleware, KeyRing
from serve.http.body_limit import BodyLimit, default_body_limit
from serve.http.errors import add_error_handlers
from serve.http.lora_modules import LoRAModulePath
from serve.http.metrics import ServerMetrics
from serve.http.middleware import MIDDLEWARE
from serve.http.openai_protocol import OpenAIError
from serve.http.serving_base import OpenAIServing
from serve.http.serving_chat import ServingChat
from serve.http.serving_completion import ServingCompletion
from serve.http.serving_lora import ServingLora, load_adapter
from serve.http.serving_models import ServingModels
from serve.http.serving_pooling import ServingPooling
from serve.http.serving_responses import ServingResponses
from serve.http.serving_status import ServingStatus
from serve.http.serving_tokenization import ServingTokenization
from serve.http.serving_weights import ServingWeights
from serve.http.state import ServerState
from serve.http.tenants import Tenant

SERVING_CLASSES: tuple[type[OpenAIServing], ...] = (
    ServingModels,
    ServingTokenization,
    ServingCompletion,
    ServingChat,
    ServingResponses,
    ServingStatus,
    ServingWeights,
    ServingPooling,
    ServingLora,
)


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    api_keys: Mapping[bytes, Tenant] | None = None,
    protect_metrics: bool = False,
    max_queue: int = 256,
    request_timeout: float | None = None,
    max_request_body_bytes: int | None = None,
    metrics: ServerMetrics | None = None,
    lora_modules: Sequence[LoRAModulePath] = (),
) -> FastAPI:
    """The FastAPI app over a running AsyncEngine (its metrics hook should feed `metrics`).
    `api_key` and `api_keys` (digest -> tenant, from --api-keys-file) are the keys every route but
    /health, /version, /ping and (unless `protect_metrics`) /metrics needs; `max_queue`: sequences
    admitted beyond max_num_seqs before a 429; `request_timeout`: seconds; `max_request_body_bytes`:
    bodies past it are 413s (default: body_limit.default_body_limit of the model's context);
    `lora_modules`: adapters served by name from the start (--lora-modules; one that cannot be served
    fails the start-up with the reason)."""
    metrics = metrics or ServerMetrics(model_name)
    if engine.on_iteration is None:
        engine.on_iteration = metrics.observe
    keys = {**(api_keys or {}), **(KeyRing.single(api_key) if api_key else {})}
    state = ServerState(engine, model_name, KeyRing(keys) if keys else None, max_queue, request_timeout, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[None]:
        application.state.loop = asyncio.get_running_loop()  # for callers on other threads (tests)
        engine.start()  # watch the core from now on, requests or not
        for module in lora_modules:
            try:
                await load_adapter(state, module)
            except OpenAIError as e:
                engine.shutdown()
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
        gc.collect()
        gc.freeze()  # the start-up heap is never garbage: full collections skip it (as vLLM's server)
        try:
            yield
        finally:
            gc.unfreeze()  # an in-process server (tests, notebooks) leaves the host's collector as it was
            engine.shutdown()

    app = FastAPI(title="jaxinfra OpenAI-compatible server", lifespan=lifespan)
    app.state.server = state
    add_error_handlers(app)
    for middleware in MIDDLEWARE:
        app.add_middleware(middleware, state=state)
    app.add_middleware(
        AuthMiddleware, keys=state.keys, open_paths=OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}
    )
    body_limit = max_request_body_bytes or default_body_limit(engine.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=body_limit)  # outermost: before anything reads the body
    for serving in SERVING_CLASSES:
        app.include_router(serving(state).router())
    return app
