"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API over the chat path.

A request becomes a chat request (instructions as the system message, input items as messages,
function tools and text.format as chat's), so tools, structured outputs and sampling behave exactly
as on /v1/chat/completions; its output becomes Responses items (a message with output_text, and
function_call items), streamed as Responses events (response.created, response.output_text.delta,
response.function_call_arguments.delta, ..., response.completed). Finished responses are kept in a
bounded in-memory store for `previous_response_id` (oldest dropped first), as vLLM's.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pydantic
from fastapi import APIRouter, Request, Response
from pydantic import Field

from serve.http.generation import Generation
from serve.http.openai_protocol import ChatCompletionRequest, OpenAIError, _Request
from serve.http.serving_base import GenerationServing
from serve.http.tool_calls import ChatGeneration, plan_tools
from serve.types import RequestOutput

STORE_SIZE = 1000  # responses kept for previous_response_id


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    user: str | None = None
    metadata: dict[str, Any] | None = None


def _text(content: Any, where: str) -> str:
    """An input item's content: a string, or parts whose text is joined (input_text, output_text); a
    400 naming `input` for anything else."""
    if isinstance(content, str):
        return content
    parts = content or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts
    ):
        raise OpenAIError(400, f"{where} must be a string or a list of parts whose text is a string", param="input")
    return "".join(p.get("text", "") for p in parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (calls and their outputs as tool_calls and tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        else:
            raise OpenAIError(400, f"input[{i}]: items of type {kind!r} are not supported", param="input")
    return messages


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request a Responses request means (`history`: the previous response's conversation)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": [
            *([{"role": "system", "content": req.instructions}] if req.instructions else []),
            *history,
            *input_messages(req.input),
        ],
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise OpenAIError(
            400, "text.format must be {'type': 'text' | 'json_object' | 'json_schema', ...}", param="text"
        )
    if fmt["type"] == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    elif fmt["type"] == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k in ("name", "description", "parameters")}}
            for t in req.tools
        ]
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body["tool_choice"] = choice
    try:
        return ChatCompletionRequest.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        loc = [str(x) for x in first["loc"]]
        renamed = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
        param = renamed.get(loc[0], loc[0]) if loc else None  # the Responses field the chat field came from
        raise OpenAIError(400, f"{first['msg']} (field: {'.'.join(loc)})", param=param) from e


class ResponseGeneration(ChatGeneration):
    """A Responses call: its id, the conversation so far (for the store) and the stream's state."""

    def __init__(self, *args: Any, responses: ResponsesRequest, history: list[dict[str, Any]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.responses = responses
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.history = history
        self.sequence = 0
        self.raw = ""  # the output so far (a stream's deltas joined)
        self.text = ""  # its content, as streamed
        self.message_id: str | None = None  # the message item, once content streams
        self.calls: dict[int, dict[str, Any]] = {}  # streamed function_call items by call index

    def event(self, type_: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": type_, "sequence_number": self.sequence - 1, **fields}

    def usage_json(self) -> dict[str, Any]:
        u = self.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": sum(out.num_cached_tokens for out in self.final.values()),
                "cache_write_tokens": 0,  # the prefix cache keeps blocks as a side effect, never by request
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    def body(self, status: str, output: list[dict[str, Any]], finish_reason: str | None = None) -> dict[str, Any]:
        r = self.responses
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model_name,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "tools": r.tools or [],
            "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "text": r.text or {"format": {"type": "text"}},
            "metadata": r.metadata or {},
            "output": output,
            "usage": self.usage_json() if status != "in_progress" else None,
        }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The assistant's message; an output cut by max_output_tokens leaves it "incomplete", as its response."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    item_id = f"fc_{call_id.rsplit('-', 1)[-1]}"
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _owner(request: Request) -> str | None:
    """Whose stored responses a request may read: its tenant's (None on a server without keys)."""
    tenant = getattr(request.state, "tenant", None)
    return tenant.name if tenant is not None else None


class ServingResponses(GenerationServing):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # response id -> (owner, body, conversation); the owner is the tenant that made it (None without keys)
        self.store: collections.OrderedDict[str, tuple[str | None, dict[str, Any], list[dict[str, Any]]]] = (
            collections.OrderedDict()
        )

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/responses", self.create, methods=["POST"])
        router.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        return router

    def _stored(self, request: Request, response_id: str, param: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """A stored response and its conversation, if the caller's tenant made it (another tenant's is
        answered exactly as one that does not exist)."""
        owner, body, conversation = self.store.get(response_id, (None, None, None))
        if body is None or conversation is None or owner != _owner(request):
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")
        return body, conversation

    async def retrieve(self, response_id: str, request: Request) -> dict[str, Any]:
        return self._stored(request, response_id, "response_id")[0]

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        req.warn_unknown()
        previous = req.previous_response_id
        history = self._stored(request, previous, "previous_response_id")[1] if previous else []
        chat = chat_request(req, history)
        self.check_request(chat)
        tools = plan_tools(chat, self.state.tools)
        text = await asyncio.to_thread(  # templates and tokenizing run off the event loop
            self.render_chat, chat.messages, True, None, tools.template_tools
        )
        ids = await asyncio.to_thread(self.tokenize, text, False)
        conversation = [*history, *input_messages(req.input)]
        gen = ResponseGeneration(
            self.state, chat, [ids], None, chat.requested_max_tokens(), tools=tools, responses=req, history=conversation
        )
        return await self.respond(request, gen)

    def _output(self, gen: ResponseGeneration, text: str, status: str) -> list[dict[str, Any]]:
        message = gen.message(text)
        calls = message.get("tool_calls", [])
        items = [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        if message.get("content") or not calls:
            items.insert(0, message_item(f"msg_{gen.response_id[5:]}", message.get("content") or "", status))
        return items

    def _keep(self, gen: ResponseGeneration, body: dict[str, Any]) -> None:
        """Store a finished response with its conversation (for previous_response_id)."""
        if not gen.responses.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        for item in body["output"]:
            if item["type"] == "message":
                reply["content"] = item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                reply.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": call})
        self.store[gen.response_id] = (gen.tenant.name if gen.tenant else None, body, [*gen.history, reply])
        while len(self.store) > STORE_SIZE:
            self.store.popitem(last=False)

    def final(self, gen: Generation, usage_only: bool) -> dict[str, Any]:
        assert isinstance(gen, ResponseGeneration)
        o = gen.final[0].outputs[0]
        status = "incomplete" if o.finish_reason == "length" else "completed"
        body = gen.body(status, self._output(gen, o.text, status), o.finish_reason)
        self._keep(gen, body)
        return body

    def chunks(self, gen: Generation, i: int, out: RequestOutput) -> Iterator[dict[str, Any]]:
        assert isinstance(gen, ResponseGeneration)
        o = out.outputs[0]
        gen.raw += o.text
        if gen.sequence == 0:
            yield gen.event("response.created", response=gen.body("in_progress", []))
            yield gen.event("response.in_progress", response=gen.body("in_progress", []))
        delta, _ = gen.delta(0, o.text, o.finished())
        if delta.get("content"):
            if gen.message_id is None:
                gen.message_id = f"msg_{gen.response_id[5:]}"
                item = {**message_item(gen.message_id, ""), "status": "in_progress", "content": []}
                yield gen.event("response.output_item.added", output_index=0, item=item)
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                yield gen.event(
                    "response.content_part.added", item_id=gen.message_id, output_index=0, content_index=0, part=part
                )
            gen.text += delta["content"]
            yield gen.event(
                "response.output_text.delta",
                item_id=gen.message_id,
                output_index=0,
                content_index=0,
                delta=delta["content"],
                logprobs=[],
            )
        for t in delta.get("tool_calls", []):
            index = t["index"] + (gen.message_id is not None)
            if "id" in t:
                gen.calls[t["index"]] = call_item(t["id"], t["function"]["name"], "")
                yield gen.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**gen.calls[t["index"]], "status": "in_progress"},
                )
            call = gen.calls[t["index"]]
            call["arguments"] += t["function"]["arguments"]
            if t["function"]["arguments"]:
                yield gen.event(
                    "response.function_call_arguments.delta",
                    item_id=call["id"],
                    output_index=index,
                    delta=t["function"]["arguments"],
                )
        if not o.finished():
            return
        status = "incomplete" if o.finish_reason == "length" else "completed"
        output = [{**c, "status": "completed"} for c in gen.calls.values()]
        if gen.message_id or not output:
            output.insert(0, message_item(gen.message_id or f"msg_{gen.response_id[5:]}", gen.text, status))
        body = gen.body(status, output, o.finish_reason)
        self._keep(gen, body)
        for index, item in enumerate(body["output"]):
            if item["type"] == "message":
                yield gen.event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=gen.text,
                    logprobs=[],
                )
                yield gen.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=item["content"][0],
                )
            else:
                yield gen.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            yield gen.event("response.output_item.done", output_index=index, item=item)
        yield gen.event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
