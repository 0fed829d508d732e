"""Ray Serve: engine replicas behind one OpenAI-compatible ingress that routes by prefix cache and
scales them on the SLO.

Each replica (`EngineReplica`, a Ray actor) holds a whole `jaxinfra serve` app (its engine core a
child process) and answers raw HTTP requests through it, streaming the body back chunk by chunk;
so every route, error and SSE stream is exactly the single server's. The ingress (`Ingress`, a
FastAPI app under Ray Serve's proxy) owns the replicas through a `ReplicaPool`: it picks one per
request with the prefix-aware router, retries on another replica a request whose replica died
before its first body byte, and sizes the pool with the SLO autoscaler (serve/scale/autoscale.py).

    jaxinfra serve --ray --replicas 2 --min-replicas 1 --max-replicas 4 --model tiny-qwen3

Replicas are actors of the ingress rather than one Ray Serve deployment so that the ingress, not
Ray's power-of-two router and request-count autoscaler, chooses among them and sets their number.
(No `from __future__ import annotations` here: FastAPI must see the ingress method's real
`Request` type through Ray Serve's wrapper.)
"""

import asyncio
import dataclasses
import json
import os
from collections.abc import AsyncIterator, MutableMapping
from typing import Any, cast

import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import ObjectRefGenerator, serve
from ray.actor import ActorHandle

from serve.config import EngineArgs
from serve.http.tool_parsers import ToolConfig
from serve.scale.replica_pool import PoolConfig, ReplicaPool

HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
RETRIES = 3  # replicas a request may try when each dies before answering
REPLICA_NAMESPACE = "jaxinfra"  # the Ray namespace of the replicas' named actors
ingress_app = FastAPI(title="jaxinfra on Ray Serve")


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What every replica runs: the engine, `build_app`'s keywords, the metric prefix, tool
    settings, and the resources its actor reserves."""

    engine_args: EngineArgs
    server_kwargs: dict[str, Any]
    metrics_prefix: str = "jaxinfra"
    tools: ToolConfig = dataclasses.field(default_factory=ToolConfig)
    warmup: bool = True
    cpus: float = 1.0
    gpus: float = 0.0


class EngineReplica:
    """One engine and its HTTP app; `handle` runs one request through the app in-process."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from serve.engine.async_engine import AsyncEngine
        from serve.http.app import build_app
        from serve.http.metrics import ServerMetrics

        self.server_metrics = ServerMetrics(spec.server_kwargs["model_name"], prefix=spec.metrics_prefix)
        self.app = build_app(
            AsyncEngine(spec.engine_args, warmup=spec.warmup), **spec.server_kwargs, metrics=self.server_metrics
        )
        self.app.state.server.tools = spec.tools
        self._lifespan: Any = None

    async def ready(self) -> bool:
        """Starts the app (the engine's supervisor) on this actor's loop; True once it serves."""
        if self._lifespan is None:
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()
        return True

    async def stop(self) -> None:
        """Stops the engine (the pool calls this after draining the replica)."""
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            await lifespan.__aexit__(None, None, None)

    def metrics(self, look_back_s: float) -> dict[str, Any]:
        """The last `look_back_s` seconds' TTFT and ITL samples, requests waiting, KV usage."""
        live = self.server_metrics.live
        since = live.clock() - look_back_s
        stats = live.stats
        return {
            "ttft": [v for t, v in live.ttft if t >= since],
            "itl": [v for t, v in live.itl if t >= since],
            "num_waiting": stats.num_waiting if stats else 0,
            "kv_usage": stats.kv_cache_usage if stats else 0.0,
        }

    async def handle(
        self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> AsyncIterator[dict[str, Any] | bytes]:
        """Yields the response's {"status", "headers"} first, then its body chunks as they come."""
        await self.ready()
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


def unavailable(message: str) -> dict[str, Any]:
    """The OpenAI error body for a request no replica can serve."""
    return {"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}}


# Ray Serve queues a deployment's requests past max_ongoing_requests (default 5): the ingress only
# relays, so its cap must stay above what the engines admit (they answer 429 themselves).
INGRESS_MAX_ONGOING_REQUESTS = 100_000


def sse_error(message: str) -> bytes:
    """The error event that ends a stream whose replica died mid-way (the openai client raises it)."""
    return f"data: {json.dumps(unavailable(message))}\n\ndata: [DONE]\n\n".encode()


@serve.deployment(max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
@serve.ingress(ingress_app)
class Ingress:
    """Relays every route to the replica the prefix-aware router picks, over a pool it sizes."""

    async def __init__(self, spec: ReplicaSpec, pool: PoolConfig, replicas: int) -> None:  # type: ignore[misc]
        from jaxinfra.loading import load_tokenizer

        args = spec.engine_args
        self.tokenizer = load_tokenizer(args.tokenizer or args.model)
        actor_cls = ray.remote(EngineReplica)

        def make_actor(name: str) -> ActorHandle:
            opts = {"name": name, "namespace": REPLICA_NAMESPACE, "num_cpus": spec.cpus, "num_gpus": spec.gpus}
            return cast(ActorHandle, actor_cls.options(**opts).remote(spec))

        self.pool = ReplicaPool(make_actor, pool, replicas, args.block_size, args.max_num_seqs)
        await self.pool.start()

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

    @ingress_app.get("/ray/replicas")
    async def replicas(self) -> JSONResponse:
        """The pool: desired count, ready replicas and their requests in flight, starting, draining."""
        return JSONResponse(self.pool.status())

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
    async def relay(self, path: str, request: Request) -> Response:
        path, body = request.url.path, await request.body()
        tokens, salt = self.routing_tokens(path, body)
        query, raw = request.url.query.encode(), request.headers.raw
        for _ in range(RETRIES):
            try:
                r, actor = self.pool.choose(tokens, salt)
            except RuntimeError as e:
                return JSONResponse(unavailable(str(e)), 503)
            stream: ObjectRefGenerator = actor.handle.options(num_returns="streaming").remote(
                request.method, path, query, raw, body
            )
            try:
                head = await (await stream.__anext__())
                first = await (await stream.__anext__())
            except StopAsyncIteration:
                first = b""
            except ray.exceptions.RayActorError:  # died before answering: nothing sent, try another
                self.pool.finished(r)
                self.pool.lost(r)
                self.pool.retried += 1
                continue
            except BaseException:
                self.pool.finished(r)
                raise
            break
        else:
            return JSONResponse(unavailable(f"{RETRIES} engine replicas died before answering"), 503)
        headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        sse = headers.get("content-type", "").startswith("text/event-stream")

        async def rest() -> AsyncIterator[bytes]:
            try:
                yield first
                async for ref in stream:
                    yield await ref
            except ray.exceptions.RayActorError:
                self.pool.lost(r)
                if sse:
                    yield sse_error("the engine replica serving this stream died")
            finally:
                self.pool.finished(r)

        return StreamingResponse(rest(), status_code=head["status"], headers=headers)


def build_ray_app(spec: ReplicaSpec, replicas: int, pool: PoolConfig) -> serve.Application:
    """The ingress deployment, which starts `replicas` engine replicas (within the pool's bounds)
    and scales them between its min and max."""
    return cast(serve.Deployment, Ingress).options(ray_actor_options={"num_cpus": 0}).bind(spec, pool, replicas)


def run(spec: ReplicaSpec, replicas: int, pool: PoolConfig, *, host: str, port: int, address: str | None) -> None:
    """`jaxinfra serve --ray`: join the cluster at `address` (or $RAY_ADDRESS; a local one is
    started without either), deploy, and serve on host:port until interrupted."""
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_ray_app(spec, replicas, pool), name="jaxinfra", route_prefix="/", blocking=True)
