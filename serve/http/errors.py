"""OpenAI error JSON for every failure: the app's exception handlers and the mapping of engine errors."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.engine.core_client import EngineDeadError
from serve.http.openai_protocol import OpenAIError
from serve.http.tenants import QuotaExceeded


def bad_request(e: Exception) -> OpenAIError:
    """A 400 for a ValueError/TypeError raised by checking a request; names the field when it can."""
    m = re.match(r"SamplingParams\.(\w+)", str(e))
    return OpenAIError(400, str(e), param=m.group(1) if m else None)


def dead(e: EngineDeadError) -> OpenAIError:
    """A 503 for a request that met a dead engine core."""
    return OpenAIError(503, f"The engine is unavailable: {e}", type_="service_unavailable", code="engine_dead")


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def quota_response(e: QuotaExceeded) -> JSONResponse:
    """A tenant's 429 past its quota, with the seconds after which the same call would fit."""
    response = error_response(OpenAIError(429, str(e), type_="rate_limit_error", code="quota_exceeded"))
    response.headers["Retry-After"] = str(e.retry_after)
    return response


def add_error_handlers(app: FastAPI) -> None:
    """OpenAIError, routing errors (404/405) and request validation (400 naming the field) as OpenAI JSON."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "method_not_allowed"}.get(e.status_code, "invalid_request_error")
        return error_response(OpenAIError(e.status_code, str(e.detail), type_=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, param = "request body is not valid JSON", None
        where = ".".join(loc)
        return error_response(OpenAIError(400, f"{message} (field: {where})" if param else message, param=param))
