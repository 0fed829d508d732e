"""Llama 3.x JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, several separated by `;`); an output that starts otherwise is content."""

from __future__ import annotations

from serve.http.tool_parsers.base import Snapshot, ToolParser, scan_call_list
from serve.http.tool_parsers.json_scan import skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def snapshot(self, text: str, final: bool) -> Snapshot:
        i = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_space(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return Snapshot("", [])  # too early to tell
        if i < len(text) and text[i] == "{":
            return Snapshot("", scan_call_list(text, i, ";")[0])
        return Snapshot(text if final or i < len(text) else "", [])
