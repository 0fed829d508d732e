"""Tool-call parsers by name, as vLLM's `--tool-call-parser`."""

from __future__ import annotations

from serve.http.tool_parsers.base import ToolParser
from serve.http.tool_parsers.hermes import HermesToolParser
from serve.http.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()
