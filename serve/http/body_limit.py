"""`--max-request-body-bytes`: a body past the limit is answered 413 before any of it is parsed, so
no request can make the frontend hold or parse megabytes. A pure ASGI middleware (no buffering):
Content-Length is checked first, then the bytes are counted as they stream in."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.http.errors import error_response
from serve.http.openai_protocol import OpenAIError

BODY_BYTES_PER_TOKEN = 64  # a token as JSON: text of up to 10 \\u-escaped characters, or an id and its comma
BODY_OVERHEAD_BYTES = 256 * 1024  # the rest of a request: messages' framing, schemas, tools, logit_bias


def default_body_limit(max_model_len: int) -> int:
    """A body that holds a prompt of the longest context the model takes, and room for the rest."""
    return max_model_len * BODY_BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"Request body too large: the limit is {limit} bytes (--max-request-body-bytes).",
        type_="invalid_request_error",
        code="request_too_large",
    )


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await error_response(too_large(self.max_bytes))(scope, receive, send)
            return
        received, refused = 0, False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # answer now; to the app, the client has gone
                    refused = True
                    await error_response(too_large(self.max_bytes))(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counted, unless_refused)
