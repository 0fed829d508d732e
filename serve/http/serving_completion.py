"""POST /v1/completions: text completions (echo, logprobs with text offsets, several prompts, n)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

from fastapi import APIRouter, Request, Response

from serve.http.generation import Generation
from serve.http.openai_protocol import CompletionRequest, OpenAIError
from serve.http.serving_base import GenerationServing
from serve.types import CompletionOutput, RequestOutput


class ServingCompletion(GenerationServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/completions", self.create, methods=["POST"])
        return router

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        self.check_request(req)
        if req.max_tokens == 0 and not req.echo:
            raise OpenAIError(400, "max_tokens must be at least 1 unless echo is true", param="max_tokens")
        prompts = req.prompts()
        self.check_never_runs(req, len(prompts))  # before any tokenizing
        ids = [await asyncio.to_thread(self.tokenize, p, req.add_special_tokens) for p in prompts]  # off the loop
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else await asyncio.to_thread(self._decode, q) for p, q in zip(prompts, ids)]
        gen = Generation(self.state, req, ids, req.logprobs, req.max_tokens, echo=echo)
        return await self.respond(request, gen)

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok else ""

    def _logprobs(self, gen: Generation, c: int, pairs: list[tuple[int, dict[int, float] | None]]) -> dict[str, Any]:
        """OpenAI's completion logprobs for (token, {token: logprob} or None) pairs, text offsets
        continuing from what this choice has shown."""
        text = self.state.token_text
        tokens = [text(t) for t, _ in pairs]
        offsets, pos = [], gen.text_offset.get(c, 0)
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        gen.text_offset[c] = pos
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp[t] for t, lp in pairs],
            "top_logprobs": [None if lp is None else {text(k): v for k, v in lp.items()} for _, lp in pairs],
            "text_offset": offsets,
        }

    def _choice(self, gen: Generation, i: int, out: RequestOutput, o: CompletionOutput) -> dict[str, Any]:
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
            "logprobs": self._logprobs(gen, c, pairs) if want_lp and (pairs or o.finished()) else None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
            **self.extras(gen, out, o, first),
        }

    def chunks(self, gen: Generation, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
        req = cast(CompletionRequest, gen.req)
        wants_tokens = req.logprobs is not None or req.return_token_ids
        for o in out.outputs:
            news = o.text or o.finished() or (wants_tokens and o.token_ids) or gen.choice(i, o.index) not in gen.started
            if not news:
                continue  # tokens whose text is still held back, and nobody asked for the tokens
            choice = self._choice(gen, i, out, o)
            yield self.chunk_usage(gen, {**self.envelope(gen, "text_completion"), "choices": [choice]})

    def final(self, gen: Generation, usage_only: bool) -> dict[str, Any]:
        body: dict[str, Any] = {**self.envelope(gen, "text_completion"), "choices": [], "usage": gen.usage()}
        body.update(gen.kv_transfer_params())
        if not usage_only:
            body["choices"] = [
                self._choice(gen, i, gen.final[i], o) for i in sorted(gen.final) for o in gen.final[i].outputs
            ]
        return body
