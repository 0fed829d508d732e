"""POST /v1/chat/completions: one conversation rendered by the model's chat template, n choices."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

from fastapi import APIRouter, Request, Response

from serve.http.generation import Generation
from serve.http.openai_protocol import ChatCompletionRequest, OpenAIError
from serve.http.serving_base import GenerationServing
from serve.http.tool_calls import ChatGeneration, plan_tools
from serve.types import CompletionOutput, RequestOutput


class ServingChat(GenerationServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/chat/completions", self.create, methods=["POST"])
        return router

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_request(req)
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        tools = plan_tools(req, self.state.tools)
        text = await asyncio.to_thread(  # templates and tokenizing run off the event loop
            self.render_chat, req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools.template_tools
        )
        ids = await asyncio.to_thread(self.tokenize, text, req.add_special_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        gen = ChatGeneration(self.state, req, [ids], logprobs, req.requested_max_tokens(), tools=tools)
        return await self.respond(request, gen)

    def _logprobs(self, o: CompletionOutput, top: int) -> dict[str, Any]:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = self.state.token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "surrogatepass"))}

        return {
            "content": [
                {**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in self.ranked(lp)[:top]]}
                for lp, t in zip(o.logprobs or [], o.token_ids)
            ]
        }

    @staticmethod
    def _echo(gen: Generation) -> str:
        """vLLM's chat echo: the last message's content, when it is the assistant's."""
        req = cast(ChatCompletionRequest, gen.req)
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    def chunks(self, gen: Generation, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
        assert isinstance(gen, ChatGeneration)
        req = cast(ChatCompletionRequest, gen.req)
        base = self.envelope(gen, "chat.completion.chunk")
        for o in out.outputs:
            c = gen.choice(i, o.index)
            first = c not in gen.started
            if first:
                gen.started.add(c)
                head = {"role": "assistant", "content": self._echo(gen)}
                yield self.chunk_usage(
                    gen,
                    {
                        **base,
                        "choices": [{"index": c, "delta": head, "logprobs": None, "finish_reason": None}],
                        **({"prompt_token_ids": out.prompt_token_ids} if req.return_token_ids else {}),
                    },
                )
            lp = self._logprobs(o, req.top_logprobs or 0) if req.logprobs and o.token_ids else None
            delta, called = gen.delta(c, o.text, o.finished())
            if not delta and not o.finished() and lp is None:
                continue
            choice = {
                "index": c,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": gen.finish_reason(o.finish_reason, called),
                "stop_reason": o.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(o.token_ids)
            yield self.chunk_usage(gen, {**base, "choices": [choice]})

    def final(self, gen: Generation, usage_only: bool) -> dict[str, Any]:
        if usage_only:
            return {**self.envelope(gen, "chat.completion.chunk"), "choices": [], "usage": gen.usage()}
        body: dict[str, Any] = {**self.envelope(gen, "chat.completion"), "choices": [], "usage": gen.usage()}
        body.update(gen.kv_transfer_params())
        assert isinstance(gen, ChatGeneration)
        req = cast(ChatCompletionRequest, gen.req)
        out = gen.final[0]
        for o in out.outputs:
            message = gen.message(self._echo(gen) + o.text)
            choice: dict[str, Any] = {
                "index": o.index,
                "message": message,
                "finish_reason": gen.finish_reason(o.finish_reason, "tool_calls" in message),
                "stop_reason": o.stop_reason,
                "logprobs": self._logprobs(o, req.top_logprobs or 0) if req.logprobs else None,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(o.token_ids)
            body["choices"].append(choice)
        if req.return_token_ids:
            body["prompt_token_ids"] = out.prompt_token_ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs)
        return body
