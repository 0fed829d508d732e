"""Tool-call parsers, picked by name as vLLM's `--tool-call-parser`."""

from __future__ import annotations

from serve.tool_parsers.base import DeltaMessage, ParsedOutput, ToolCall, ToolCallDelta, ToolCallStream, ToolParser
from serve.tool_parsers.config import ToolConfig
from serve.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema
from serve.tool_parsers.registry import TOOL_PARSERS, get_tool_parser

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
