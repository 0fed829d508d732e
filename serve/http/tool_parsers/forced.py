"""Parsers for outputs that structured outputs forced into a call shape: a named `tool_choice` (the
output is the function's arguments object) and `"required"` (a JSON list of {"name", "parameters"})."""

from __future__ import annotations

import json
from typing import Any

from serve.http.tool_parsers.base import ParsedOutput, PartialCall, Snapshot, ToolCall, ToolParser, scan_call_list
from serve.http.tool_parsers.json_scan import skip_space


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the one function tool_choice names."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return Snapshot("", [PartialCall(self.function, text.strip(), complete=final)])


class RequiredToolParser(ToolParser):
    """The output is a non-empty JSON list of calls (tool_choice "required")."""

    name = "required"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_space(text, 0)
        if i < len(text) and text[i] == "[":
            return Snapshot("", scan_call_list(text, i + 1, ",")[0])
        return Snapshot("", [])

    def extract(self, text: str) -> ParsedOutput:
        """Every complete call, as the stream sends them: a list cut short by max_tokens keeps the calls
        written before the cut (the text is the content only when no call is complete)."""
        calls = []
        for c in self.snapshot(text, final=True).calls:
            if c.name is None or not c.complete:
                break
            try:
                json.loads(c.arguments or "{}")
            except ValueError:
                break
            calls.append(ToolCall(c.name, c.arguments or "{}"))
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema that forces a list of one or more calls of the given function tools (vLLM's)."""
    choices = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": choices} if len(choices) > 1 else choices[0]}
