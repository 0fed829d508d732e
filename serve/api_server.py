"""OpenAI-compatible HTTP server (FastAPI on uvicorn) over the AsyncEngine.

    jaxinfra serve --model <dir or preset> [--port 8000] [--api-key KEY] [--max-queue N] ...
    python -m serve ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfra.loading import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from serve.async_engine import AsyncEngine
from serve.config import EngineArgs
from serve.engine import LLMEngine
from serve.metrics import ServerMetrics
from serve.openai_protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, _Common
from serve.outputs import RequestOutput


class ServerState:
    def __init__(self, engine: LLMEngine, model_name: str, api_key: str | None, max_queue: int,
                 request_timeout: float | None) -> None:
        self.metrics = ServerMetrics(model_name)
        self.engine = AsyncEngine(engine, on_step=self.metrics.observe, on_abort=self.metrics.forget)
        self.model_name = model_name
        self.api_key = api_key
        self.capacity = engine.args.max_num_seqs + max_queue
        self.request_timeout = request_timeout
        self.in_flight = 0
        self.created = int(time.time())


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _token_text(engine: LLMEngine, token: int) -> str:
    return engine.tokenizer.decode([token], skip_special_tokens=False) if engine.tokenizer else str(token)


def _max_tokens(state: ServerState, req: _Common, requested: int | None, prompt_len: int) -> int:
    limit = state.engine.engine.max_model_len
    if prompt_len >= limit:
        raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                               f"{prompt_len} tokens, leaving no room for a completion.", param="messages"
                          if isinstance(req, ChatCompletionRequest) else "prompt")
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                               f"completion). Please reduce the prompt or max_tokens.", param="max_tokens")
    return requested


def _encode(state: ServerState, prompt: str | list[int]) -> list[int]:
    engine = state.engine.engine
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer: send token ids", param="prompt")
        return engine.tokenizer.encode(prompt)
    if not prompt or any(t < 0 or t >= engine.model_config.vocab_size for t in prompt):
        raise OpenAIError(400, f"prompt token ids must be non-empty and in [0, {engine.model_config.vocab_size})",
                          param="prompt")
    return list(prompt)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams, tagging each output with its stream's index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
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
    """One API call: its engine requests, how they map to choices, and the text already streamed."""

    def __init__(self, state: ServerState, req: _Common, prompts: list[list[int]], logprobs: int | None,
                 requested_max: int | None) -> None:
        self.state, self.req = state, req
        self.prompts = prompts
        self.ids = [state.engine.new_request_id("cmpl") for _ in prompts]
        self.params = [req.sampling_params(_max_tokens(state, req, requested_max, len(p)), logprobs) for p in prompts]
        self.sent: dict[int, int] = {}
        self.final: dict[int, RequestOutput] = {}

    async def start(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        streams = []
        try:
            for rid, prompt, params in zip(self.ids, self.prompts, self.params):
                streams.append(await self.state.engine.add_request(rid, prompt, params))
        except ValueError as e:
            for rid in self.ids:
                self.state.engine.abort(rid)
            raise OpenAIError(400, str(e)) from e
        return _merge(streams)

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.req.n + seq_index

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(o.token_ids) for out in self.final.values() for o in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def delta(self, choice: int, text: str, finished: bool) -> str:
        """New text since the last chunk; a trailing partial UTF-8 character waits for the next token."""
        start = self.sent.get(choice, 0)
        end = len(text) if finished or not text.endswith("\ufffd") else len(text.rstrip("\ufffd"))
        end = max(end, start)
        self.sent[choice] = end
        return text[start:end]


def build_app(engine: LLMEngine, *, model_name: str, api_key: str | None = None, max_queue: int = 256,
              request_timeout: float | None = None) -> FastAPI:
    state = ServerState(engine, model_name, api_key, max_queue, request_timeout)
    app = FastAPI(title="jaxinfra OpenAI-compatible server")
    app.state.server = state

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        elif first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        where = ".".join(loc)
        return _error(OpenAIError(400, f"{message} (field: {where})" if param else message, param=param))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
                return _error(OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(state.engine.error)}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "jaxinfra", "max_model_len": engine.max_model_len}]}

    def _check_model(req: _Common) -> None:
        if req.model != state.model_name:
            raise OpenAIError(404, f"The model '{req.model}' does not exist.", param="model", code="model_not_found")
        req.check_supported()

    async def _run(request: Request, gen: _Generation, render, final) -> Response:
        if state.in_flight >= state.capacity:
            raise OpenAIError(429, "The server is overloaded: too many requests in flight. Retry later.",
                              type_="rate_limit_error")
        state.in_flight += 1
        try:
            merged = await gen.start()
        except BaseException:
            state.in_flight -= 1
            raise
        if gen.req.stream:
            async def sse() -> AsyncIterator[str]:
                try:
                    async with asyncio.timeout(state.request_timeout):
                        async for i, out in merged:
                            if out.finished:
                                gen.final[i] = out
                            for chunk in render(gen, i, out):
                                yield f"data: {json.dumps(chunk)}\n\n"
                    if gen.req.stream_options and gen.req.stream_options.include_usage:
                        yield f"data: {json.dumps(final(gen, usage_only=True))}\n\n"
                    yield "data: [DONE]\n\n"
                except TimeoutError:
                    err = OpenAIError(408, "request timed out", type_="timeout")
                    yield f"data: {json.dumps(err.body())}\n\n"
                finally:
                    await merged.aclose()
                    state.in_flight -= 1

            return StreamingResponse(sse(), media_type="text/event-stream")

        async def collect() -> None:
            async for i, out in merged:
                if out.finished:
                    gen.final[i] = out

        async def watch_disconnect() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)

        worker, watcher = asyncio.create_task(collect()), asyncio.create_task(watch_disconnect())
        try:
            done, _ = await asyncio.wait({worker, watcher}, timeout=state.request_timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if worker not in done:
                worker.cancel()
                if watcher in done:
                    return Response(status_code=499)
                raise OpenAIError(408, "request timed out", type_="timeout")
            worker.result()
            return JSONResponse(final(gen, usage_only=False))
        finally:
            watcher.cancel()
            await merged.aclose()
            state.in_flight -= 1

    # --- /v1/completions -----------------------------------------------------------------------
    def completion_logprobs(out_logprobs, token_ids, start: int = 0) -> dict[str, Any]:
        tokens = [_token_text(engine, t) for t in token_ids[start:]]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens,
                "token_logprobs": [lp[t] for lp, t in zip(out_logprobs[start:], token_ids[start:])],
                "top_logprobs": [{_token_text(engine, k): v for k, v in lp.items()} for lp in out_logprobs[start:]],
                "text_offset": offsets}

    def completion_chunks(gen: _Generation, i: int, out: RequestOutput):
        for o in out.outputs:
            c = gen.choice_index(i, o.index)
            before = gen.sent.get(("tok", c), 0)
            delta = gen.delta(c, o.text, o.finished())
            new_tokens = len(o.token_ids) > before
            if not delta and not o.finished() and not (new_tokens and o.logprobs is not None):
                continue
            gen.sent[("tok", c)] = len(o.token_ids)
            lp = completion_logprobs(o.logprobs, o.token_ids, before) if o.logprobs is not None else None
            yield {"id": gen.ids[0], "object": "text_completion", "created": int(time.time()),
                   "model": state.model_name,
                   "choices": [{"index": c, "text": delta, "logprobs": lp, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason}]}

    def completion_final(gen: _Generation, usage_only: bool) -> dict[str, Any]:
        body = {"id": gen.ids[0], "object": "text_completion", "created": int(time.time()),
                "model": state.model_name, "choices": [], "usage": gen.usage()}
        if usage_only:
            return body
        for i in sorted(gen.final):
            for o in gen.final[i].outputs:
                body["choices"].append({
                    "index": gen.choice_index(i, o.index), "text": o.text, "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                    "logprobs": completion_logprobs(o.logprobs, o.token_ids) if o.logprobs is not None else None})
        return body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        _check_model(req)
        ids = [_encode(state, p) for p in req.prompts()]
        gen = _Generation(state, req, ids, req.logprobs, req.max_tokens if req.max_tokens is not None else 16)
        return await _run(request, gen, completion_chunks, completion_final)

    # --- /v1/chat/completions ------------------------------------------------------------------
    def chat_logprobs(out_logprobs, token_ids, top: int, start: int = 0) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = _token_text(engine, t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in list(lp.items())[:top]]}
                            for lp, t in zip(out_logprobs[start:], token_ids[start:])]}

    def chat_chunks(gen: _Generation, i: int, out: RequestOutput):
        req = gen.req
        for o in out.outputs:
            c = gen.choice_index(i, o.index)
            base = {"id": gen.ids[0], "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": state.model_name}
            if ("role", c) not in gen.sent:
                gen.sent[("role", c)] = 1
                yield {**base, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            before = gen.sent.get(("tok", c), 0)
            delta = gen.delta(c, o.text, o.finished())
            if not delta and not o.finished() and not (len(o.token_ids) > before and req.logprobs):
                continue
            gen.sent[("tok", c)] = len(o.token_ids)
            lp = chat_logprobs(o.logprobs, o.token_ids, req.top_logprobs or 0, before) if req.logprobs else None
            yield {**base, "choices": [{"index": c, "delta": {"content": delta} if delta else {},
                                        "logprobs": lp, "finish_reason": o.finish_reason}]}

    def chat_final(gen: _Generation, usage_only: bool) -> dict[str, Any]:
        body = {"id": gen.ids[0], "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
                "choices": [], "usage": gen.usage()}
        if usage_only:
            return {**body, "object": "chat.completion.chunk"}
        for o in gen.final[0].outputs:
            body["choices"].append({
                "index": o.index, "message": {"role": "assistant", "content": o.text},
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                "logprobs": chat_logprobs(o.logprobs, o.token_ids, gen.req.top_logprobs or 0)
                if gen.req.logprobs else None})
        return body

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        _check_model(req)
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise OpenAIError(400, "this model has no chat template", param="messages")
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        messages = [m.as_template_dict() for m in req.messages]
        try:
            ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                       tokenize=True)
        except Exception as e:  # a template's raise_exception(), or a malformed conversation
            raise OpenAIError(400, f"chat template error: {e}", param="messages") from e
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gen = _Generation(state, req, [ids], logprobs, req.requested_max_tokens())
        return await _run(request, gen, chat_chunks, chat_final)

    @app.on_event("shutdown")
    async def _shutdown() -> None:
        state.engine.shutdown()

    return app


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> Iterator[str]:
    """Run `app` with uvicorn on a background thread (tests, benchmarks, notebooks); yields its URL."""
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
    p.add_argument("--model", default=None,
                   help="local HF directory, training run directory or preset name (default: the embedded model)")
    p.add_argument("--config", help="engine arguments from a YAML file (configs/serve/*.yaml)")
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-queue", type=int, default=256, help="requests allowed to wait beyond max-num-seqs; more get 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cut off")
    p.add_argument("--dtype", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool off GPU")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip compiling all batch shapes at start")
    return p


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    overrides = {k: v for k, v in dict(
        model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, seed=args.seed).items() if v is not None}
    if args.config:
        return EngineArgs.from_yaml(args.config, **overrides)
    return EngineArgs(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    try:
        engine_args = engine_args_from(args)
        engine = LLMEngine.from_engine_args(engine_args)
    except ValueError as e:
        print(f"jaxinfra serve: error: {e}", file=sys.stderr)
        return 2
    if not args.no_warmup:
        engine.runner.warmup()
    name = args.served_model_name or (DEFAULT_MODEL_NAME if engine_args.model == DEFAULT_MODEL else engine_args.model)
    app = build_app(engine, model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                    request_timeout=args.request_timeout)
    base = f"http://{args.host}:{args.port}"
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    print(f"serving {name} on {base}\n  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'\n"
          f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='{args.api_key or 'none'}'); "
          f"print(c.completions.create(model='{name}', prompt='Hello', max_tokens=16).choices[0].text)\"", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
