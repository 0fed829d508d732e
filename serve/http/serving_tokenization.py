"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from jaxinfra.tokenizer import Tokenizer
from serve.http.openai_protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from serve.http.serving_base import OpenAIServing


class ServingTokenization(OpenAIServing):
    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        router.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        router.add_api_route("/tokenizer_info", self.tokenizer_info, methods=["GET"])
        return router

    def _tokenizer(self, model: str | None) -> Tokenizer:
        """The served model's tokenizer (a 404 for another model, a 400 if it has none)."""
        self.check_model(model)
        if self.engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", param="model")
        return self.engine.tokenizer

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        tok = self._tokenizer(req.model)
        req.warn_unknown()
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        if req.messages is not None:
            text = await asyncio.to_thread(
                self.render_chat, req.messages, req.add_generation_prompt, req.chat_template_kwargs
            )
            special = bool(req.add_special_tokens)  # the template wrote them already
        else:
            text, special = req.prompt or "", req.add_special_tokens is not False
        try:
            ids = await asyncio.to_thread(tok.encode, text, special)  # off the event loop
        except (UnicodeError, TypeError, ValueError) as e:
            raise OpenAIError(400, f"prompt is not valid text: {e}", param="prompt") from e
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tok.tok.id_to_token(t) for t in ids]
        return body

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, str]:
        tok = self._tokenizer(req.model)
        req.warn_unknown()
        if not all(0 <= t < self.engine.vocab_size for t in req.tokens):
            raise OpenAIError(400, f"tokens must be ids in [0, {self.engine.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens, skip_special_tokens=False)}

    async def tokenizer_info(self) -> dict[str, Any]:
        tok = self._tokenizer(None)
        return {
            "tokenizer_class": tok.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "vocab_size": tok.vocab_size,
            "model_max_length": self.engine.max_model_len,
            "eos_token_ids": list(tok.eos_token_ids),
            "chat_template": tok.chat_template,
            **tok.special_tokens,
        }
