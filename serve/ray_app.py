"""Ray Serve: N engine replicas behind one OpenAI-compatible ingress that routes by prefix cache.

Each replica (`EngineReplica`, a Ray actor) holds a whole `jaxinfra serve` app (its engine core a
child process) and answers raw HTTP requests through it, streaming the body back chunk by chunk;
so every route, error and SSE stream is exactly the single server's. The ingress (`Ingress`, a
FastAPI app under Ray Serve's proxy) picks a replica per request with `PrefixAwareRouter` (the
prompt's block-hash chain against each replica's queue) and relays the response.

    jaxinfra serve --ray --replicas 2 --model tiny-qwen3 [--ray-address ADDR] [--ray-gpus-per-replica 0.5]

Replicas are separate named deployments of one class so that the ingress, not Ray's power-of-two
router, chooses among them. (No `from __future__ import annotations` here: FastAPI must see the
ingress method's real `Request` type through Ray Serve's wrapper.)
"""

import asyncio
import json
import os
from collections.abc import AsyncIterator, MutableMapping
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from serve.config import EngineArgs
from serve.prefix_router import PrefixAwareRouter

HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
ingress_app = FastAPI(title="jaxinfra on Ray Serve")


@serve.deployment
class EngineReplica:
    """One engine and its HTTP app; `handle` runs one request through the app in-process."""

    def __init__(self, engine_args: EngineArgs, server_kwargs: dict[str, Any], warmup: bool) -> None:
        from serve.async_engine import AsyncEngine
        from serve.http.app import build_app

        self.app = build_app(AsyncEngine(engine_args, warmup=warmup), **server_kwargs)
        self._lifespan: Any = None

    async def handle(
        self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Yields the response's {"status", "headers"} first, then its body chunks as they come."""
        if self._lifespan is None:  # the app's startup (the engine's supervisor) on this actor's loop
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 80),
        }
        messages: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (msg := await messages.get()) is not None:
                if msg["type"] == "http.response.start":
                    yield {"status": msg["status"], "headers": [(k.decode(), v.decode()) for k, v in msg["headers"]]}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        break
        finally:
            gone.set()  # the client left, or the body is complete: the app sees a disconnect
            await asyncio.wait({task}, timeout=10)


@serve.deployment
@serve.ingress(ingress_app)
class Ingress:
    """Relays every route to the replica the prefix-aware router picks for the request."""

    def __init__(self, replicas: list[DeploymentHandle], engine_args: EngineArgs) -> None:
        from jaxinfra.loading import load_tokenizer

        self.replicas = replicas
        self.tokenizer = load_tokenizer(engine_args.tokenizer or engine_args.model)
        self.router = PrefixAwareRouter(len(replicas), engine_args.block_size, max_num_seqs=engine_args.max_num_seqs)

    def routing_tokens(self, path: str, body: bytes) -> tuple[list[int], str | None]:
        """The prompt's token ids (what the engine's prefix cache is keyed by) and its cache salt;
        nothing for requests that carry no prompt (they go to the least loaded replica)."""
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            return [], None
        if not isinstance(req, dict):
            return [], None
        salt = req.get("cache_salt") if isinstance(req.get("cache_salt"), str) else None
        try:
            if path == "/v1/completions":
                prompt = req.get("prompt")
                prompt = prompt[0] if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else prompt
                if isinstance(prompt, str):
                    return self.tokenizer.encode(prompt), salt
                if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    return prompt, salt
            elif path == "/v1/chat/completions" and self.tokenizer.chat_template is not None:
                text = self.tokenizer.apply_chat_template(req.get("messages") or [], True)
                return self.tokenizer.encode(text), salt
        except Exception:  # a malformed request: the replica answers it with the proper 400
            return [], None
        return [], None

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def relay(self, path: str, request: Request) -> StreamingResponse:
        path, body = request.url.path, await request.body()
        tokens, salt = self.routing_tokens(path, body)
        r = self.router.choose(tokens, salt)
        try:
            handle = self.replicas[r].options(stream=True)
            query, raw = request.url.query.encode(), request.headers.raw
            stream = cast(DeploymentResponseGenerator, handle.handle.remote(request.method, path, query, raw, body))
            head = await stream.__anext__()
        except BaseException:
            self.router.finished(r)
            raise

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                self.router.finished(r)

        headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        return StreamingResponse(rest(), status_code=head["status"], headers=headers)


def build_ray_app(
    engine_args: EngineArgs,
    replicas: int,
    server_kwargs: dict[str, Any],
    *,
    warmup: bool = True,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
) -> serve.Application:
    """The application: `replicas` engine deployments (each `gpus_per_replica` GPUs; a fraction
    lets small models share a card) and the ingress over them."""
    engines = [
        cast(serve.Deployment, EngineReplica)
        .options(
            name=f"engine-{i}",
            ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        )
        .bind(engine_args, server_kwargs, warmup)
        for i in range(replicas)
    ]
    return cast(serve.Deployment, Ingress).options(ray_actor_options={"num_cpus": 0}).bind(engines, engine_args)


def run(
    engine_args: EngineArgs,
    replicas: int,
    server_kwargs: dict[str, Any],
    *,
    host: str,
    port: int,
    address: str | None,
    warmup: bool,
    gpus_per_replica: float,
) -> None:
    """`jaxinfra serve --ray`: join the cluster at `address` (or $RAY_ADDRESS; a local one is
    started without either), deploy, and serve on host:port until interrupted."""
    import ray

    ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    app = build_ray_app(
        engine_args, replicas, server_kwargs, warmup=warmup, cpus_per_replica=0.5, gpus_per_replica=gpus_per_replica
    )
    serve.run(app, name="jaxinfra", route_prefix="/", blocking=True)
