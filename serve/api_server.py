"""OpenAI-compatible HTTP server (FastAPI on uvicorn) over the AsyncEngine.

    jaxinfra serve --model <dir or preset> [--port 8000] [--api-key KEY] [--max-queue N] ...
    python -m serve ...

This process tokenizes, detokenizes and streams; the engine core (scheduler, KV cache, model) runs
in a process of its own. Bad input is a 4xx for that request alone; a dead core is a 503 for new
requests and an error event on every open stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfra.loading import DEFAULT_MODEL, DEFAULT_MODEL_NAME, QUANTIZATION_CHOICES
from serve.async_engine import AsyncEngine
from serve.config import EngineArgs
from serve.core_client import EngineDeadError
from serve.metrics import ServerMetrics
from serve.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, _Common
from serve.outputs import CompletionOutput, Logprobs, RequestOutput
from serve.sampling_params import OutputKind
from serve.tokenizer_routes import add_tokenizer_routes, render_chat


def bad_request(e: Exception) -> OpenAIError:
    """A 400 for a ValueError/TypeError raised by checking a request; names the field when it can."""
    m = re.match(r"SamplingParams\.(\w+)", str(e))
    return OpenAIError(400, str(e), param=m.group(1) if m else None)


def dead(e: EngineDeadError) -> OpenAIError:
    return OpenAIError(503, f"The engine is unavailable: {e}", type_="service_unavailable", code="engine_dead")


class ServerState:
    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        api_key: str | None,
        max_queue: int,
        request_timeout: float | None,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.api_key = api_key
        self.capacity = engine.args.max_num_seqs + max_queue  # sequences (prompts x n) in flight
        self.request_timeout = request_timeout
        self.in_flight = 0
        self.created = int(time.time())

    def token_text(self, token: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token], skip_special_tokens=False) if tok else str(token)


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several request streams, tagging each output with its stream's index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # surfaced to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let each pump leave its stream first
        for s in streams:
            await s.aclose()


class _Generation:
    """One API call: its engine requests (one per prompt), how they map to choices, and what has
    been streamed of each choice."""

    def __init__(
        self,
        state: ServerState,
        req: _Common,
        prompts: list[list[int]],
        logprobs: int | None,
        requested_max: int | None,
        *,
        echo: list[str] | None = None,
    ) -> None:
        """`echo`: the prompts' text, put before each choice's output (completions' echo)."""
        self.state, self.req, self.prompts, self.echo = state, req, prompts, echo
        self.echo_only = echo is not None and requested_max == 0  # max_tokens 0: the prompt alone
        self.id = f"{'chatcmpl' if isinstance(req, ChatCompletionRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        self.ids = [f"{self.id}-{i}" for i in range(len(prompts))]
        kind: OutputKind = "delta" if req.stream else "final_only"
        at_least_one = None if requested_max is None else max(requested_max, 1)
        try:
            self.params = [req.sampling_params(self._max_tokens(at_least_one, len(p)), logprobs, kind) for p in prompts]
        except (ValueError, TypeError) as e:
            raise bad_request(e) from e
        if echo is not None and logprobs is not None:  # echoed tokens carry their logprobs too
            k = max(logprobs, req.prompt_logprobs or 0)
            self.params = [dataclasses.replace(p, prompt_logprobs=k) for p in self.params]
        self.num_seqs = len(prompts) * req.n
        self.completion_tokens = 0
        self.final: dict[int, RequestOutput] = {}
        self.text_offset: dict[int, int] = {}
        self.started: set[int] = set()  # choices that have shown their first output

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        limit = self.state.engine.max_model_len
        param = "messages" if isinstance(self.req, ChatCompletionRequest) else "prompt"
        if prompt_len >= limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, leaving no room for a completion.",
                param=param,
            )
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return requested

    async def start(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        streams: list[AsyncGenerator[RequestOutput, None]] = []
        try:
            for rid, prompt, params in zip(self.ids, self.prompts, self.params):
                streams.append(
                    await self.state.engine.add_request(
                        rid, prompt, params, cache_salt=self.req.cache_salt, priority=self.req.priority
                    )
                )
        except BaseException as e:
            for s in streams:
                await s.aclose()
            if isinstance(e, EngineDeadError):
                raise dead(e) from e
            if isinstance(e, (ValueError, TypeError)):
                raise bad_request(e) from e
            raise
        self.state.metrics.observe_prompt(sum(len(p) for p in self.prompts))
        return _merge(streams)

    def choice(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.req.n + seq_index

    def record(self, i: int, out: RequestOutput) -> None:
        """Count an output's tokens (new ones in a stream; all, once, otherwise) and keep the last."""
        if self.echo_only:  # the one token generated to get there is not part of the answer
            for o in out.outputs:
                o.text, o.token_ids, o.logprobs = "", [], ([] if o.logprobs is not None else None)
        self.completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        if out.finished:
            self.final[i] = out

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }


Render = Callable[[_Generation, int, RequestOutput], Iterator[dict[str, Any]]]
Final = Callable[[_Generation, bool], dict[str, Any]]


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_queue: int = 256,
    request_timeout: float | None = None,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The FastAPI app over a running AsyncEngine (its metrics hook should feed `metrics`)."""
    metrics = metrics or ServerMetrics(model_name)
    if engine.on_iteration is None:
        engine.on_iteration = metrics.observe
    state = ServerState(engine, model_name, api_key, max_queue, request_timeout, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(application: FastAPI):
        application.state.loop = asyncio.get_running_loop()  # for callers on other threads (tests)
        yield
        engine.shutdown()

    app = FastAPI(title="jaxinfra OpenAI-compatible server", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(e.status_code, "invalid_request_error")
        return _error(OpenAIError(e.status_code, str(e.detail), type_=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        where = ".".join(loc)
        return _error(OpenAIError(400, f"{message} (field: {where})" if param else message, param=param))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if (
            state.api_key
            and request.url.path.startswith("/v1")
            and request.headers.get("authorization", "") != f"Bearer {state.api_key}"
        ):
            return _error(OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            return JSONResponse(
                {"status": "error", "error": engine.error or "the engine core is not running"}, status_code=503
            )
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "jaxinfra",
                    "root": engine.args.model,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, state.model_name).hex}",
                            "object": "model_permission",
                            "created": state.created,
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
            ],
        }

    def _check_model(req: _Common) -> None:
        if req.model is not None and req.model != state.model_name:
            raise OpenAIError(404, f"The model '{req.model}' does not exist.", param="model", code="model_not_found")
        req.check_supported()
        if req.priority != 0 and engine.args.scheduling_policy != "priority":
            raise OpenAIError(
                400, "priority needs the server started with --scheduling-policy priority", param="priority"
            )

    def _tokenize(prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        try:
            return engine.input_processor.tokenize(prompt, add_special_tokens)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prompt") from e

    async def _run(request: Request, gen: _Generation, render: Render, final: Final) -> Response:
        if state.in_flight + gen.num_seqs > state.capacity:
            raise OpenAIError(
                429, "The server is overloaded: too many sequences in flight. Retry later.", type_="rate_limit_error"
            )
        state.in_flight += gen.num_seqs
        try:
            merged = await gen.start()
        except BaseException:
            state.in_flight -= gen.num_seqs
            raise
        if gen.req.stream:
            return StreamingResponse(_stream(gen, merged, render, final), media_type="text/event-stream")

        async def collect() -> None:
            async for i, out in merged:
                gen.record(i, out)

        async def watch_disconnect() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)

        worker, watcher = asyncio.create_task(collect()), asyncio.create_task(watch_disconnect())
        try:
            done, _ = await asyncio.wait(
                {worker, watcher}, timeout=state.request_timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if worker not in done:
                worker.cancel()
                if watcher in done:
                    return Response(status_code=499)
                raise OpenAIError(408, "request timed out", type_="timeout")
            try:
                worker.result()
            except EngineDeadError as e:
                raise dead(e) from e
            except (ValueError, TypeError) as e:
                raise bad_request(e) from e
            return JSONResponse(final(gen, False))
        finally:
            watcher.cancel()
            await merged.aclose()
            state.in_flight -= gen.num_seqs

    async def _stream(
        gen: _Generation, merged: AsyncGenerator[tuple[int, RequestOutput], None], render: Render, final: Final
    ) -> AsyncIterator[str]:
        try:
            async with asyncio.timeout(state.request_timeout):
                async for i, out in merged:
                    gen.record(i, out)
                    for chunk in render(gen, i, out):
                        yield _sse(chunk)
            if gen.req.stream_options and gen.req.stream_options.include_usage:
                yield _sse(final(gen, True))
        except TimeoutError:
            yield _sse(OpenAIError(408, "request timed out", type_="timeout").body())
        except EngineDeadError as e:
            yield _sse(dead(e).body())
        except (ValueError, TypeError) as e:
            yield _sse(bad_request(e).body())
        finally:
            await merged.aclose()
            state.in_flight -= gen.num_seqs
        yield "data: [DONE]\n\n"

    # --- shared formatting ---------------------------------------------------------------------
    def ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])

    def prompt_logprobs_json(plp: Logprobs | list[dict[int, float] | None] | None) -> list[Any] | None:
        """vLLM's layout: None for the first token, then {token id: {logprob, rank, decoded_token}}
        (the actual token and the top alternatives; rank is known within the top alternatives)."""
        if plp is None:
            return None
        out: list[Any] = []
        for entry in plp:
            if entry is None:
                out.append(None)
                continue
            top = ranked(entry)[: len(entry) - 1] if len(entry) > 1 else ranked(entry)
            ranks = {t: r + 1 for r, (t, _) in enumerate(top)}
            out.append(
                {
                    str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": state.token_text(t)}
                    for t, lp in entry.items()
                }
            )
        return out

    def extras(gen: _Generation, out: RequestOutput, o: CompletionOutput, first: bool) -> dict[str, Any]:
        """vLLM's per-choice extensions: token ids (return_token_ids) and prompt logprobs."""
        body: dict[str, Any] = {}
        if gen.req.return_token_ids:
            body["token_ids"] = list(o.token_ids)
            if first:
                body["prompt_token_ids"] = out.prompt_token_ids
        if gen.req.prompt_logprobs is not None and first:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return body

    def chunk_usage(gen: _Generation, chunk: dict[str, Any]) -> dict[str, Any]:
        opts = gen.req.stream_options
        if opts is not None and opts.continuous_usage_stats:
            chunk["usage"] = gen.usage()
        return chunk

    # --- /v1/completions -----------------------------------------------------------------------
    def completion_logprobs(
        gen: _Generation, c: int, pairs: list[tuple[int, dict[int, float] | None]]
    ) -> dict[str, Any]:
        """OpenAI's completion logprobs for (token, {token: logprob} or None) pairs, text offsets
        continuing from what this choice has shown."""
        tokens = [state.token_text(t) for t, _ in pairs]
        offsets, pos = [], gen.text_offset.get(c, 0)
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        gen.text_offset[c] = pos
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t] for t, lp in pairs],
            "top_logprobs": [
                None if lp is None else {state.token_text(k): v for k, v in lp.items()} for _, lp in pairs
            ],
            "text_offset": offsets,
        }

    def completion_choice(gen: _Generation, i: int, out: RequestOutput, o: CompletionOutput) -> dict[str, Any]:
        """One choice's text and logprobs so far; the echoed prompt comes before the first."""
        c = gen.choice(i, o.index)
        first = c not in gen.started
        gen.started.add(c)
        pairs: list[tuple[int, dict[int, float] | None]] = list(zip(o.token_ids, o.logprobs or []))
        text = o.text
        if gen.echo is not None and first:
            text = gen.echo[i] + text
            prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            pairs = [*zip(out.prompt_token_ids, prompt_lps), *pairs]
        want_lp = cast(CompletionRequest, gen.req).logprobs is not None
        return {
            "index": c,
            "text": text,
            "logprobs": completion_logprobs(gen, c, pairs) if want_lp and (pairs or o.finished()) else None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
            **extras(gen, out, o, first),
        }

    def completion_chunks(gen: _Generation, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
        req = cast(CompletionRequest, gen.req)
        wants_tokens = req.logprobs is not None or req.return_token_ids
        for o in out.outputs:
            news = o.text or o.finished() or (wants_tokens and o.token_ids) or gen.choice(i, o.index) not in gen.started
            if not news:
                continue  # tokens whose text is still held back, and nobody asked for the tokens
            choice = completion_choice(gen, i, out, o)
            yield chunk_usage(
                gen,
                {
                    "id": gen.id,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": state.model_name,
                    "choices": [choice],
                },
            )

    def completion_final(gen: _Generation, usage_only: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": gen.id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [],
            "usage": gen.usage(),
        }
        if not usage_only:
            body["choices"] = [
                completion_choice(gen, i, gen.final[i], o) for i in sorted(gen.final) for o in gen.final[i].outputs
            ]
        return body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        _check_model(req)
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError(400, "max_tokens must be at least 1 unless echo is true", param="max_tokens")
        ids = [_tokenize(p, req.add_special_tokens) for p in req.prompts()]
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else _decode(q) for p, q in zip(req.prompts(), ids)]
        gen = _Generation(state, req, ids, req.logprobs, req.max_tokens, echo=echo)
        return await _run(request, gen, completion_chunks, completion_final)

    def _decode(ids: list[int]) -> str:
        tok = engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok else ""

    # --- /v1/chat/completions ------------------------------------------------------------------
    def chat_logprobs(o: CompletionOutput, top: int) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = state.token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "surrogatepass"))}

        return {
            "content": [
                {**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in ranked(lp)[:top]]}
                for lp, t in zip(o.logprobs or [], o.token_ids)
            ]
        }

    def chat_echo(gen: _Generation) -> str:
        """vLLM's chat echo: the last message's content, when it is the assistant's."""
        req = cast(ChatCompletionRequest, gen.req)
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    def chat_chunks(gen: _Generation, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
        req = cast(ChatCompletionRequest, gen.req)
        base = {"id": gen.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": state.model_name}
        for o in out.outputs:
            c = gen.choice(i, o.index)
            first = c not in gen.started
            if first:
                gen.started.add(c)
                head = {"role": "assistant", "content": chat_echo(gen)}
                yield chunk_usage(
                    gen,
                    {
                        **base,
                        "choices": [{"index": c, "delta": head, "logprobs": None, "finish_reason": None}],
                        **({"prompt_token_ids": out.prompt_token_ids} if req.return_token_ids else {}),
                    },
                )
            lp = chat_logprobs(o, req.top_logprobs or 0) if req.logprobs and o.token_ids else None
            if not o.text and not o.finished() and lp is None:
                continue
            choice = {
                "index": c,
                "delta": {"content": o.text} if o.text else {},
                "logprobs": lp,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(o.token_ids)
            yield chunk_usage(gen, {**base, "choices": [choice]})

    def chat_final(gen: _Generation, usage_only: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": gen.id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [],
            "usage": gen.usage(),
        }
        if usage_only:
            return {**body, "object": "chat.completion.chunk"}
        req = cast(ChatCompletionRequest, gen.req)
        out = gen.final[0]
        for o in out.outputs:
            choice: dict[str, Any] = {
                "index": o.index,
                "message": {"role": "assistant", "content": chat_echo(gen) + o.text},
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "logprobs": chat_logprobs(o, req.top_logprobs or 0) if req.logprobs else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(o.token_ids)
            body["choices"].append(choice)
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return body

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        _check_model(req)
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        ids = _tokenize(
            render_chat(engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs),
            req.add_special_tokens,
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gen = _Generation(state, req, [ids], logprobs, req.requested_max_tokens())
        return await _run(request, gen, chat_chunks, chat_final)

    add_tokenizer_routes(app, engine, state.model_name)
    return app


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Run `app` with uvicorn on a background thread (tests, benchmarks, notebooks); yields its URL.
    Stopping it shuts the engine down."""
    import uvicorn

    if port is None:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            app.state.server.engine.shutdown()
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        app.state.server.engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxinfra serve", description="OpenAI-compatible server")
    p.add_argument(
        "--model",
        default=None,
        help="local HF directory, training run directory or preset name (default: the embedded model)",
    )
    p.add_argument("--config", help="engine arguments from a YAML file (configs/serve/*.yaml)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="sequences allowed to wait beyond max-num-seqs; requests past that get 429",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cut off")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument(
        "--quantization",
        "-q",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="the checkpoint's quantization method (default: read from its config.json), or int8 / int4 "
        "to round a dense model's linears as it loads (W8A16, W4A16 group 128)",
    )
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool off GPU")
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        help="decode steps per jitted loop when the batch is decode-only and nothing waits",
    )
    p.add_argument("--no-async-scheduling", action="store_true", help="read each step's results before the next")
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default=None,
        help="priority: requests' `priority` field orders admission and preemption (lower first)",
    )
    p.add_argument("--compilation-cache-dir", default=None, help="JAX's persistent compilation cache ('' = off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip compiling all batch shapes at start")
    p.add_argument(
        "--restart-engine",
        action="store_true",
        help="start a new engine core if it dies (in-flight requests still fail)",
    )
    return p


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    overrides = {
        k: v
        for k, v in dict(
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            block_size=args.block_size,
            quantization=args.quantization,
            kv_cache_memory=args.kv_cache_memory,
            num_scheduler_steps=args.num_scheduler_steps,
            compilation_cache_dir=args.compilation_cache_dir,
            seed=args.seed,
            async_scheduling=False if args.no_async_scheduling else None,
            scheduling_policy=args.scheduling_policy,
        ).items()
        if v is not None
    }
    if args.config:
        return EngineArgs.from_yaml(args.config, **overrides)
    return EngineArgs(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    try:
        engine_args = engine_args_from(args)
        engine = AsyncEngine(engine_args, warmup=not args.no_warmup, restart_on_failure=args.restart_engine)
    except (ValueError, RuntimeError) as e:
        print(f"jaxinfra serve: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (DEFAULT_MODEL_NAME if engine_args.model == DEFAULT_MODEL else engine_args.model)
    app = build_app(
        engine, model_name=name, api_key=args.api_key, max_queue=args.max_queue, request_timeout=args.request_timeout
    )
    base = f"http://{args.host}:{args.port}"
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    print(
        f"serving {name} on {base}\n  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}\'\n'
        f'  python -c "from openai import OpenAI; '
        f"c = OpenAI(base_url='{base}/v1', api_key='{args.api_key or 'none'}'); "
        f"print(c.completions.create(model='{name}', prompt='Hello', max_tokens=16).choices[0].text)\"",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
