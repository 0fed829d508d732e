"""A scanner for JSON objects that may still be arriving: where each top-level value starts and (once
written) ends, so a tool call's name is known as soon as its string closes and its arguments can be
streamed as the exact characters the model wrote."""

from __future__ import annotations

import dataclasses
import json
import re

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_SPACE = re.compile(r"\s*")


def skip_space(text: str, i: int) -> int:
    m = _SPACE.match(text, i)
    return m.end() if m else i


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at text[i], or None if the text ends inside it."""
    depth, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            m = _STRING.match(text, i)
            if m is None:
                return None
            i = m.end()
            if depth == 0:
                return i
            continue
        if ch in "{[":
            depth += 1
        elif depth == 0 and (ch in ",}]" or ch.isspace()):
            return i  # the end of a scalar
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@dataclasses.dataclass
class ScannedObject:
    """Top-level keys of an object -> (value start, value end or None while unfinished)."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None  # just past the closing brace, None while unfinished


def scan_object(text: str, i: int) -> ScannedObject | None:
    """Scan the object whose "{" is text[i]; None when what is there is not JSON."""
    fields: dict[str, tuple[int, int | None]] = {}
    i, n = i + 1, len(text)
    while True:
        i = skip_space(text, i)
        if i >= n:
            return ScannedObject(fields, None)
        if text[i] == "}":
            return ScannedObject(fields, i + 1)
        if text[i] == "," and fields:
            i += 1
            continue
        if text[i] != '"':
            return None
        m = _STRING.match(text, i)
        if m is None:
            return ScannedObject(fields, None)
        key = json.loads(m.group())
        i = skip_space(text, m.end())
        if i >= n:
            return ScannedObject(fields, None)
        if text[i] != ":":
            return None
        i = skip_space(text, i + 1)
        if i >= n:
            return ScannedObject(fields, None)
        end = value_end(text, i)
        fields[key] = (i, end)
        if end is None:
            return ScannedObject(fields, None)
        i = end
