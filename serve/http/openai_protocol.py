"""OpenAI request schemas (pydantic), with vLLM's extensions, and their translation to SamplingParams.

Like vLLM's server, fields this server does not know are ignored (and logged), not refused; fields
it knows but does not implement are a clear 400.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve.sampling_params import MAX_LOGPROBS, OutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("jaxinfra.serve")

# Known fields this server refuses with a 400 rather than ignore (ignoring them would change the answer).
UNSUPPORTED = ("functions", "function_call", "suffix", "audio", "prediction")
# Nesting a request body may have: far past real ones (OpenAI's schemas nest at most 10 objects deep),
# far short of what exhausts Python's recursion where schemas are copied and compiled.
MAX_JSON_DEPTH = 64


class OpenAIError(Exception):
    """An error answered with OpenAI's error JSON and a 4xx status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """The error JSON, always encodable (a quoted lone surrogate once made the error itself a 500)."""
        param = None if self.param is None else _encodable(self.param)
        return {"error": {"message": _encodable(self.message), "type": self.type, "param": param, "code": self.code}}


def _encodable(text: str) -> str:
    """`text` with each lone surrogate (from a request's \\ud800 escape) as that escape: UTF-8 cannot encode one."""
    return text.encode("utf-8", "backslashreplace").decode()


def _bad_scalar(value: Any) -> str | None:
    """Why a JSON scalar (or key) is not one JSON text can hold, if it is not: NaN and infinities (which
    Python's json reads) and lone surrogates (a \\ud800 escape: not Unicode, so nothing can encode it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"holds {value}: NaN and infinities are not JSON numbers"
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as e:
            return f"holds {value[e.start]!a}, a lone surrogate: not valid Unicode"
    return None


def json_problem(body: dict[str, Any]) -> tuple[str, str] | None:
    """The top-level field of a parsed request body that holds what no JSON text should (see
    `_bad_scalar`) or nests past MAX_JSON_DEPTH, and why; None if there is none. Iterative: a
    deep body cannot exhaust the recursion this guards."""
    stack: list[tuple[str, str, Any, int]] = [("", "", body, 0)]  # (top-level field, path, node, depth)
    while stack:
        field, path, node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return field, f"{field} nests deeper than {MAX_JSON_DEPTH} levels"
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            why = _bad_scalar(key) or _bad_scalar(value)
            if why is not None or isinstance(value, (dict, list)):
                top, where = (str(key), str(key)) if depth == 0 else (field, f"{path}.{key}")
                if why is not None:
                    return top, f"{where} {why}"
                stack.append((top, where, value, depth + 1))
    return None


class _Lenient(BaseModel):
    """Unknown fields are kept aside (`model_extra`) and logged by `warn_unknown`."""

    model_config = ConfigDict(extra="allow")

    def warn_unknown(self, where: str = "") -> None:
        for name in self.model_extra or {}:
            logger.warning("ignoring unknown request field %r", f"{where}{name}")


class _Request(_Lenient):
    """A whole request body: a 400 naming the field, before anything else, for what JSON cannot hold."""

    @model_validator(mode="before")
    @classmethod
    def _valid_json(cls, body: Any) -> Any:
        problem = json_problem(body) if isinstance(body, dict) else None
        if problem is not None:  # an OpenAIError passes through pydantic (a ValueError would lose the field)
            raise OpenAIError(400, problem[1], param=problem[0])
        return body


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchema(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Common(_Request):
    """Sampling fields shared by both endpoints (OpenAI's, plus vLLM's extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False
    cache_salt: str | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    kv_transfer_params: dict[str, Any] | None = None  # disaggregation (vLLM's): read by the KV connector
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    use_beam_search: bool = False  # best_of (or n) beams; the n best are the choices (not streamed)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    tools: list[Any] | None = None  # chat: function tools (serve/http/tool_calls.py); completions: ignored
    # known, refused (see UNSUPPORTED)
    functions: list[Any] | None = None
    function_call: Any = None
    suffix: str | None = None
    audio: Any = None
    prediction: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def check_supported(self) -> None:
        """A 400 for what this server refuses; unknown fields are logged."""
        self.warn_unknown()
        for nested, where in ((self.stream_options, "stream_options."), (self.response_format, "response_format.")):
            if nested is not None:
                nested.warn_unknown(where)
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, False, [], {}):
                raise OpenAIError(400, f"'{name}' is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.use_beam_search and self.stream:
            raise OpenAIError(400, "use_beam_search answers are not streamed", param="stream")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise OpenAIError(
                400,
                f"best_of ({self.best_of}) must equal n ({self.n}): ranking extra samples is not supported "
                "(as in vLLM V1)",
                param="best_of",
            )

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint from whichever field carries it (one at most)."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        try:
            if self.structured_outputs is not None:
                found.append(("structured_outputs", StructuredOutputsParams(**self.structured_outputs)))
            for field, key in (
                ("guided_json", "json"),
                ("guided_regex", "regex"),
                ("guided_choice", "choice"),
                ("guided_grammar", "grammar"),
            ):
                if getattr(self, field) is not None:
                    found.append((field, StructuredOutputsParams(**{key: getattr(self, field)})))
            rf = self.response_format
            if rf is not None and rf.type == "json_object":
                found.append(("response_format", StructuredOutputsParams(json_object=True)))
            elif rf is not None and rf.type == "json_schema":
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise ValueError("response_format json_schema needs json_schema.schema")
                strict = rf.json_schema.strict  # OpenAI's strict: false -> JSON Schema's own reading
                lenient = None if strict is None else not strict  # unset: the server's default
                so = StructuredOutputsParams(json=rf.json_schema.schema_, additional_properties=lenient)
                found.append(("response_format", so))
        except (TypeError, ValueError) as e:
            raise OpenAIError(400, str(e), param=found[-1][0] if found else "structured_outputs") from e
        if len(found) > 1:
            fields = ", ".join(name for name, _ in found)
            raise OpenAIError(400, f"give one output constraint, got {fields}", param=found[1][0])
        if found and isinstance(found[0][1].json, str):
            field = found[0][0]
            try:
                problem = json_problem({field: json.loads(found[0][1].json)})  # as if the schema came as JSON
            except (ValueError, RecursionError) as e:
                raise OpenAIError(400, f"the JSON schema is not valid JSON: {e}", param=field) from e
            if problem is not None:
                raise OpenAIError(400, f"the JSON schema string: {problem[1]}", param=field)
        return found[0][1] if found else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, output_kind: OutputKind) -> SamplingParams:
        """The engine's settings for this request (a ValueError names a bad field)."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=output_kind,
            structured_outputs=self.structured(),
            logit_bias=self.token_bias(),
            use_beam_search=self.use_beam_search,
            best_of=self.best_of if self.use_beam_search else None,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): value for token, value in self.logit_bias.items()}
        except ValueError as e:
            raise OpenAIError(400, "logit_bias keys must be token ids", param="logit_bias") from e


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [[int(t) for t in p]]  # one token-id prompt
        return [q if isinstance(q, str) else list(q) for q in p]  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call

    def text(self) -> str:
        content = self.content
        return "".join(part.text for part in content) if isinstance(content, list) else content or ""

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it; a call's arguments as an object (as vLLM passes them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError as e:
            raise OpenAIError(400, f"a tool call's arguments are not JSON: {e}", param="messages") from e
    return {**call, "function": function}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # known, refused
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: prepend the last message's content when it is the assistant's
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None  # false: at most one call (tool_choice "required")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message:
            raise OpenAIError(
                400, "continue_final_message is not supported by this server", param="continue_final_message"
            )


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
