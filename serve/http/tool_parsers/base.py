"""What every tool parser shares: the parsed forms of a model's output (whole, and as OpenAI's
streaming deltas) and the streaming machinery.

A parser only says what a text *so far* holds (`snapshot`): the content that is safe to show and the
calls begun, each with its name once written and the characters of its arguments written so far.
Snapshots of a growing text extend each other, so streaming sends the difference between the last
two, and the concatenated stream equals the whole-text extraction.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, ClassVar

from serve.http.tool_parsers.json_scan import ScannedObject, scan_object, skip_space

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters", Hermes/Qwen "arguments"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclasses.dataclass
class ToolCall:
    """One complete call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedOutput:
    """A whole output: its content (None when only calls were written) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class PartialCall:
    name: str | None  # None until its string is complete
    arguments: str  # the raw characters of the arguments value written so far
    complete: bool = False


@dataclasses.dataclass
class Snapshot:
    content: str
    calls: list[PartialCall]
    malformed: bool = False  # the text cannot be calls in this format (the whole text is content)


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of a call as OpenAI streams it: id, type and name first, then arguments fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclasses.dataclass
class DeltaMessage:
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def call_from_object(text: str, obj: ScannedObject) -> PartialCall:
    """The call an object (complete or not) describes: {"name": ..., "arguments"|"parameters": {...}}."""
    name = None
    if "name" in obj.fields:
        start, end = obj.fields["name"]
        if end is not None:
            value = json.loads(text[start:end])
            name = value if isinstance(value, str) else None
    arguments = ""
    for key in ARGUMENT_KEYS:
        if key in obj.fields:
            start, end = obj.fields[key]
            arguments = text[start : len(text) if end is None else end]
            break
    return PartialCall(name, arguments, complete=obj.end is not None)


def scan_call_list(text: str, i: int, separators: str) -> tuple[list[PartialCall], bool]:
    """Calls written as objects from text[i] on, separated by any of `separators`; also whether the
    text is well-formed so far."""
    calls: list[PartialCall] = []
    while True:
        i = skip_space(text, i)
        while calls and i < len(text) and text[i] in separators:
            i = skip_space(text, i + 1)
        if i >= len(text):
            return calls, True
        if text[i] != "{":
            return calls, text[i] == "]" and bool(calls)
        obj = scan_object(text, i)
        if obj is None:
            return calls, False
        calls.append(call_from_object(text, obj))
        if obj.end is None:
            return calls, True
        i = obj.end


def hold_back(text: str, marker: str) -> str:
    """`text` less a trailing start of `marker` and trailing whitespace (either may still change meaning)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            text = text[:-k]
            break
    return text.rstrip()


class ToolParser:
    """Turns a model's output text into content and tool calls, whole or streamed."""

    name: ClassVar[str]

    def snapshot(self, text: str, final: bool) -> Snapshot:
        """What `text` holds so far; `final` when no more text will come."""
        raise NotImplementedError

    def extract(self, text: str) -> ParsedOutput:
        """Content and calls of a whole output; malformed calls leave the text as content (as vLLM's)."""
        snap = self.snapshot(text, final=True)
        if snap.malformed:
            return ParsedOutput(text, [])
        calls = []
        for c in snap.calls:
            if c.name is None or not c.complete:
                return ParsedOutput(text, [])
            try:
                json.loads(c.arguments or "{}")
            except ValueError:
                return ParsedOutput(text, [])
            calls.append(ToolCall(c.name, c.arguments or "{}"))
        return ParsedOutput(snap.content or None, calls)


class ToolCallStream:
    """Feed the output's text deltas; get content and tool-call deltas as OpenAI streams them."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # per announced call: its id, argument chars sent

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, delta: str, final: bool = False) -> DeltaMessage:
        self.text += delta
        snap = self.parser.snapshot(self.text, final)
        if final and not self.sent:  # nothing announced: what the whole text says
            whole = self.parser.extract(self.text)
            snap = Snapshot(whole.content or "", [PartialCall(c.name, c.arguments, True) for c in whole.tool_calls])
        out = DeltaMessage()
        if len(snap.content) > self.content_sent:
            out.content = snap.content[self.content_sent :]
            self.content_sent = len(snap.content)
        for index, call in enumerate(snap.calls):
            if index == len(self.sent):
                if call.name is None:
                    break
                self.sent.append((new_call_id(), 0))
                out.tool_calls.append(ToolCallDelta(index, "", self.sent[index][0], call.name))
            call_id, sent = self.sent[index]
            if len(call.arguments) > sent:
                out.tool_calls.append(ToolCallDelta(index, call.arguments[sent:]))
                self.sent[index] = (call_id, len(call.arguments))
        return out
