"""Hermes-style calls (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call; the content is what comes before the first block."""

from __future__ import annotations

from serve.http.tool_parsers.base import PartialCall, Snapshot, ToolParser, call_from_object, hold_back
from serve.http.tool_parsers.json_scan import scan_object, skip_space

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        pos = text.find(START)
        if pos < 0:
            return Snapshot(text if final else hold_back(text, START), [])
        content = text[:pos].rstrip()
        calls: list[PartialCall] = []
        while pos >= 0:
            i = skip_space(text, pos + len(START))
            obj = scan_object(text, i) if text.startswith("{", i) else None
            if obj is None:  # not a JSON object: malformed, unless it has not begun yet
                return Snapshot(content, calls, malformed=i < len(text))
            calls.append(call_from_object(text, obj))
            if obj.end is None:
                break
            pos = text.find(START, obj.end)  # the object ends the block, whatever its strings hold
        return Snapshot(content, calls)
