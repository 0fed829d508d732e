"""Tool calling on /v1/chat/completions, as vLLM does it: the tools go to the chat template; a named
`tool_choice` or "required" is enforced with structured outputs (the function's parameters schema,
or a list of calls over all functions); "auto" parses the output with the `--tool-call-parser`
(needs `--enable-auto-tool-choice`); "none" keeps the tools in the template and parses nothing."""

from __future__ import annotations

import dataclasses
from typing import Any

from serve.http.generation import Generation
from serve.http.openai_protocol import ChatCompletionRequest, OpenAIError
from serve.http.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    ToolConfig,
    ToolParser,
    get_tool_parser,
    required_schema,
)
from serve.sampling_params import StructuredOutputsParams


@dataclasses.dataclass
class ToolPlan:
    """What a request's tools mean: the template's `tools`, a constraint on the output, its parser."""

    template_tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None
    named: bool = False  # OpenAI answers a named tool_choice with finish_reason "stop"


def _check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    for i, t in enumerate(tools):
        function = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(function, dict):
            raise OpenAIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise OpenAIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return tools


def plan_tools(req: ChatCompletionRequest, config: ToolConfig) -> ToolPlan:
    """The plan for a request's `tools` and `tool_choice` (a 400 for what cannot be served)."""
    tools = _check_tools(req.tools or [])
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools and config.enable_auto_tool_choice else "none"
    if choice == "none":
        return ToolPlan(tools or None)
    if not tools:
        raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
    if choice != "auto" and req.structured() is not None:
        why = f"tool_choice {choice!r} cannot be combined with an output constraint"
        raise OpenAIError(400, why, param="tool_choice")
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.parser is None:
            raise OpenAIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
        return ToolPlan(tools, parser=get_tool_parser(config.parser))
    if choice == "required":
        schema = required_schema(tools)
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(tools, StructuredOutputsParams(json=schema), RequiredToolParser())
    named = choice.get("function") if isinstance(choice, dict) else None  # {"name": ...}, if well formed
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError(
            400,
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    function = next((t["function"] for t in tools if t["function"]["name"] == name), None)
    if function is None:
        raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    schema = function.get("parameters") or {"type": "object"}
    return ToolPlan(tools, StructuredOutputsParams(json=schema), NamedToolParser(name), named=True)


class ChatGeneration(Generation):
    """A chat call with its tool plan (the constraint applied to every choice) and, while streaming,
    each choice's tool-call stream."""

    def __init__(self, *args: Any, tools: ToolPlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        if tools.constraint is not None:
            self.params = [dataclasses.replace(p, structured_outputs=tools.constraint) for p in self.params]
        self.tool_streams: dict[int, ToolCallStream] = {}

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        return "tool_calls" if reason == "stop" and called and not self.tools.named else reason

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole output: its content, and its tool calls when parsed."""
        if self.tools.parser is None:
            return {"role": "assistant", "content": text}
        parsed = self.tools.parser.extract(text)
        calls = [c.to_openai() for c in parsed.tool_calls]
        return {"role": "assistant", "content": parsed.content, **({"tool_calls": calls} if calls else {})}

    def delta(self, choice: int, text: str, final: bool) -> tuple[dict[str, Any], bool]:
        """The stream delta for new text of a choice, and whether that choice has called a tool."""
        if self.tools.parser is None:
            return ({"content": text} if text else {}), False
        stream = self.tool_streams.setdefault(choice, ToolCallStream(self.tools.parser))
        d = stream.feed(text, final)
        delta: dict[str, Any] = {"content": d.content} if d.content else {}
        if d.tool_calls:
            delta["tool_calls"] = [t.to_openai() for t in d.tool_calls]
        return delta, stream.called
