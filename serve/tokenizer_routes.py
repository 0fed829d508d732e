"""vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info) and /version, and the chat
rendering they share with /v1/chat/completions."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI

from serve.async_engine import AsyncEngine
from serve.openai_protocol import ChatMessage, DetokenizeRequest, OpenAIError, TokenizeRequest


def render_chat(
    engine: AsyncEngine,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> str:
    """The conversation as the model's chat template writes it (a 400 if it cannot)."""
    tok = engine.tokenizer
    if tok is None or tok.chat_template is None:
        raise OpenAIError(400, "this model has no chat template", param="messages")
    reserved = {"messages", "add_generation_prompt", *tok.special_tokens}
    clash = sorted(reserved & set(template_kwargs or {}))
    if clash:
        raise OpenAIError(400, f"chat_template_kwargs may not set {clash}", param="chat_template_kwargs")
    try:
        return tok.apply_chat_template(
            [m.as_template_dict() for m in messages], add_generation_prompt, **(template_kwargs or {})
        )
    except Exception as e:  # a template's raise_exception(), or a malformed conversation
        raise OpenAIError(400, f"chat template error: {e}", param="messages") from e


def add_tokenizer_routes(app: FastAPI, engine: AsyncEngine, model_name: str) -> None:
    def check(model: str | None) -> None:
        if model is not None and model != model_name:
            raise OpenAIError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
        if engine.tokenizer is None:
            raise OpenAIError(400, "this model has no tokenizer", param="model")

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": importlib.metadata.version("jaxinfra")}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check(req.model)
        req.warn_unknown()
        assert engine.tokenizer is not None
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        if req.messages is not None:
            text = render_chat(engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
            special = bool(req.add_special_tokens)  # the template wrote them already
        else:
            text, special = req.prompt or "", req.add_special_tokens is not False
        try:
            ids = engine.tokenizer.encode(text, special)
        except (UnicodeError, TypeError, ValueError) as e:
            raise OpenAIError(400, f"prompt is not valid text: {e}", param="prompt") from e
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [engine.tokenizer.tok.id_to_token(t) for t in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check(req.model)
        req.warn_unknown()
        assert engine.tokenizer is not None
        if not all(0 <= t < engine.vocab_size for t in req.tokens):
            raise OpenAIError(400, f"tokens must be ids in [0, {engine.vocab_size})", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        check(None)
        assert engine.tokenizer is not None
        tok = engine.tokenizer
        return {
            "tokenizer_class": tok.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "vocab_size": tok.vocab_size,
            "model_max_length": engine.max_model_len,
            "eos_token_ids": list(tok.eos_token_ids),
            "chat_template": tok.chat_template,
            **tok.special_tokens,
        }
