"""The base of every endpoint's serving class, and of the generating ones (completions, chat):
the model check, chat rendering, admission, the timeout, the SSE stream and the response envelope."""

from __future__ import annotations

import abc
import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.engine.core_client import EngineDeadError
from serve.http.beam import beam_search_answer
from serve.http.errors import bad_request, dead, quota_response
from serve.http.generation import Generation, collect
from serve.http.openai_protocol import ChatMessage, OpenAIError, _Common
from serve.http.prompt_bound import surely_too_long
from serve.http.state import ServerState
from serve.http.tenants import NeverFits, QuotaExceeded
from serve.types import CompletionOutput, Logprobs, LoRARequest, RequestOutput


def sse(body: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body)}\n\n"


class OpenAIServing(abc.ABC):
    """One endpoint family over the shared server state; app.py includes each class's router."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    @abc.abstractmethod
    def router(self) -> APIRouter:
        """The routes this class serves."""

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: absent or the base model's name); a 404 for any other name."""
        return self.state.resolve_model(model)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation (and the function tools offered) as the model's chat template writes it
        (a 400 if it cannot)."""
        tok = self.engine.tokenizer
        if tok is None or tok.chat_template is None:
            raise OpenAIError(400, "this model has no chat template", param="messages")
        reserved = {"messages", "add_generation_prompt", *tok.special_tokens}
        clash = sorted(reserved & set(template_kwargs or {}))
        if clash:
            raise OpenAIError(400, f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs")
        try:
            extra: dict[str, Any] = {**({"tools": tools} if tools else {}), **(template_kwargs or {})}
            return tok.apply_chat_template(
                [m.as_template_dict() for m in messages], add_generation_prompt, tokenize=False, **extra
            )
        except Exception as e:  # a template's raise_exception(), or a malformed conversation
            raise OpenAIError(400, f"chat template error: {e}", param="messages") from e


class GenerationServing(OpenAIServing):
    """An endpoint that generates: subclasses render their chunks and final body; this class admits
    the call, runs it under the timeout (stopping on a client disconnect) or streams it as SSE."""

    @abc.abstractmethod
    def chunks(self, gen: Generation, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
        """The stream chunks for one output of prompt `i`."""

    @abc.abstractmethod
    def final(self, gen: Generation, usage_only: bool) -> dict[str, Any]:
        """The whole response body (or, `usage_only`, the stream's closing usage chunk)."""

    def check_request(self, req: _Common) -> None:
        self.check_model(req.model)
        if self.engine.args.runner == "pooling":  # as vLLM: a pooling model does not generate
            raise OpenAIError(400, "this server runs --runner pooling: it serves embeddings, score and rerank")
        req.check_supported()
        if req.priority != 0 and self.engine.args.scheduling_policy != "priority":
            raise OpenAIError(
                400, "priority needs the server started with --scheduling-policy priority", param="priority"
            )

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """A prompt's token ids (a 400 if it is bad, or its length alone shows it cannot fit)."""
        limit = self.engine.max_model_len
        if isinstance(prompt, str) and surely_too_long(self.engine.tokenizer, prompt, limit):
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(prompt)} characters, more than {limit} tokens of this tokenizer can hold.",
                param="prompt",
            )
        try:
            return self.engine.input_processor.tokenize(prompt, add_special_tokens)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prompt") from e

    def envelope(self, gen: Generation, object_: str) -> dict[str, Any]:
        """The fields every response body and stream chunk starts with."""
        return {"id": gen.id, "object": object_, "created": int(time.time()), "model": gen.model_name}

    def check_never_runs(self, req: _Common, prompts: int) -> None:
        """A 400 for a call of `prompts` prompts that can never run: more sequences a prompt (n, best_of
        or beams) than --max-num-seqs, or more in all than the server admits. Completions ask it before
        tokenizing, so 60,000 prompts cost no tokenizing; admission asks it for every call."""
        per_prompt, most, capacity = max(req.n, req.best_of or 1), self.engine.args.max_num_seqs, self.state.capacity
        if per_prompt > most or prompts * per_prompt > capacity:
            field = "best_of" if req.use_beam_search else "n"
            raise OpenAIError(
                400,
                f"This request needs {prompts * per_prompt} sequences ({prompts} prompts of {per_prompt}); the server "
                f"runs at most {most} at once and admits {capacity}, so it can never run.",
                param="prompt" if prompts > 1 and per_prompt <= most else field,
            )

    def admit(self, request: Request, gen: Generation) -> Response | None:
        """Count `gen`'s sequences (prompts x n, or x beams) in against the server's capacity and its
        tenant's quotas: a 400 for a call that can never run, a 429 past capacity; returns the 429 with
        Retry-After past the tenant's quota. One path for every kind of call (beam search included)."""
        state = self.state
        self.check_never_runs(gen.req, len(gen.prompts))
        if state.in_flight + gen.num_seqs > state.capacity:
            raise OpenAIError(
                429, "The server is overloaded: too many sequences in flight. Retry later.", type_="rate_limit_error"
            )
        tenant = getattr(request.state, "tenant", None)
        if tenant is not None:
            reserved = max(p.max_tokens or 0 for p in gen.params)
            try:
                gen.admission = state.quotas.admit(tenant, sum(map(len, gen.prompts)), gen.num_seqs, reserved)
            except NeverFits as e:
                raise OpenAIError(400, str(e), param=e.param) from e
            except QuotaExceeded as e:
                return quota_response(e)
            gen.tenant = tenant
        state.in_flight += gen.num_seqs
        return None

    async def respond(self, request: Request, gen: Generation) -> Response:
        """Admit `gen`, start it, and answer with its body or its SSE stream."""
        refused = self.admit(request, gen)
        if refused is not None:
            return refused
        streaming = False
        try:
            if gen.params[0].use_beam_search:
                work = beam_search_answer(self.state, gen)
            else:
                merged = await gen.start()
                if gen.req.stream:
                    streaming = True  # the stream finishes the call
                    return StreamingResponse(self._stream(gen, merged), media_type="text/event-stream")
                work = collect(gen, merged)
            return await self._answer(request, gen, work)
        finally:
            if not streaming:
                self.finish(gen)

    async def _answer(self, request: Request, gen: Generation, work: Coroutine[Any, Any, None]) -> Response:
        """Run `work` (which records gen's outputs) to its end and answer with the whole body; a 499 if
        the client leaves first and a 408 past the request timeout (either way the work is cancelled, which
        aborts its engine requests)."""

        async def watch_disconnect() -> None:  # vLLM's listen_for_disconnect: the body is read, so
            while (await request.receive())["type"] != "http.disconnect":  # the next message is the end
                pass

        worker, watcher = asyncio.create_task(work), asyncio.create_task(watch_disconnect())
        try:
            done, _ = await asyncio.wait(
                {worker, watcher}, timeout=self.state.request_timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if worker not in done:
                if watcher in done:
                    return Response(status_code=499)
                raise OpenAIError(408, "request timed out", type_="timeout")
            try:
                worker.result()
            except EngineDeadError as e:
                raise dead(e) from e
            except (ValueError, TypeError) as e:
                raise bad_request(e) from e
            return JSONResponse(self.final(gen, False))
        finally:
            for task in (worker, watcher):
                task.cancel()
            await asyncio.gather(worker, watcher, return_exceptions=True)

    def finish(self, gen: Generation) -> None:
        """The call is over (answered, failed or abandoned): its sequences leave the in-flight count,
        its tenant is charged for what it generated, the live stats forget its requests."""
        self.state.in_flight -= gen.num_seqs
        if gen.tenant is not None and gen.admission is not None:
            self.state.quotas.release(gen.tenant, gen.admission, gen.completion_tokens)
        for rid in gen.ids:
            self.state.metrics.finish_request(rid)

    async def _stream(
        self, gen: Generation, merged: AsyncGenerator[tuple[int, RequestOutput], None]
    ) -> AsyncIterator[str]:
        try:
            async with asyncio.timeout(self.state.request_timeout):
                async for i, out in merged:
                    gen.record(i, out)
                    for chunk in self.chunks(gen, i, out):
                        yield sse(chunk)
            if gen.req.stream_options and gen.req.stream_options.include_usage:
                yield sse(self.final(gen, True))
        except TimeoutError:
            yield sse(OpenAIError(408, "request timed out", type_="timeout").body())
        except EngineDeadError as e:
            yield sse(dead(e).body())
        except (ValueError, TypeError) as e:
            yield sse(bad_request(e).body())
        finally:
            await merged.aclose()
            self.finish(gen)
        yield "data: [DONE]\n\n"

    # --- formatting shared by completions and chat ----------------------------------------------
    @staticmethod
    def ranked(entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])

    def prompt_logprobs_json(self, plp: Logprobs | list[dict[int, float] | None] | None) -> list[Any] | None:
        """vLLM's layout: None for the first token, then {token id: {logprob, rank, decoded_token}}
        (the actual token and the top alternatives; rank is known within the top alternatives)."""
        if plp is None:
            return None
        out: list[Any] = []
        for entry in plp:
            if entry is None:
                out.append(None)
                continue
            top = self.ranked(entry)[: len(entry) - 1] if len(entry) > 1 else self.ranked(entry)
            ranks = {t: r + 1 for r, (t, _) in enumerate(top)}
            out.append(
                {
                    str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": self.state.token_text(t)}
                    for t, lp in entry.items()
                }
            )
        return out

    def extras(self, gen: Generation, out: RequestOutput, o: CompletionOutput, first: bool) -> dict[str, Any]:
        """vLLM's per-choice extensions: token ids (return_token_ids) and prompt logprobs."""
        body: dict[str, Any] = {}
        if gen.req.return_token_ids:
            body["token_ids"] = list(o.token_ids)
            if first:
                body["prompt_token_ids"] = out.prompt_token_ids
        if gen.req.prompt_logprobs is not None and first:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs)
        return body

    @staticmethod
    def chunk_usage(gen: Generation, chunk: dict[str, Any]) -> dict[str, Any]:
        """With stream_options.continuous_usage_stats, every chunk carries the usage so far."""
        opts = gen.req.stream_options
        if opts is not None and opts.continuous_usage_stats:
            chunk["usage"] = gen.usage()
        return chunk
