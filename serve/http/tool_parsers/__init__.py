"""Tool-call parsers, picked by name as vLLM's `--tool-call-parser`."""

from __future__ import annotations

from serve.http.tool_parsers.base import DeltaMessage, ParsedOutput, ToolCall, ToolCallDelta, ToolCallStream, ToolParser
from serve.http.tool_parsers.config import ToolConfig
from serve.http.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema
from serve.http.tool_parsers.registry import TOOL_PARSERS, get_tool_parser

__all__ = [
    "TOOL_PARSERS",
    "DeltaMessage",
    "NamedToolParser",
    "ParsedOutput",
    "RequiredToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolConfig",
    "ToolParser",
    "get_tool_parser",
    "required_schema",
]
