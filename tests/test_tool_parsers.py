"""Tool parsers on outputs as Qwen2.5/Qwen3 (hermes) and Llama 3.x (llama3_json) write them: whole,
and streamed with the text split at every position and token by token, against the calls they hold."""

import json

import pytest

from serve.http.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    ToolParser,
    get_tool_parser,
    required_schema,
)

WEATHER = {"location": "San Francisco, CA, USA", "unit": "celsius"}
TRICKY = {"query": 'say "hi" {x} </tool_call>', "filters": {"tags": ["a", "b"], "n": [1, 2.5e3]}, "ok": True, "u": "é"}

# (parser, output text, expected content, expected [(name, arguments)])
CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": '
        '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>',
        None,
        [("get_current_temperature", WEATHER)],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": '
        '{"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
        None,
        [
            ("get_current_temperature", WEATHER),
            ("get_temperature_date", {**WEATHER, "date": "2024-10-01"}),
        ],
    ),
    (
        "hermes",
        "<think>\nThe user asks for the weather, so I call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "search", "arguments": ' + json.dumps(TRICKY, ensure_ascii=False) + "}\n</tool_call>",
        "<think>\nThe user asks for the weather, so I call the tool.\n</think>",
        [("search", TRICKY)],
    ),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>', None, [("now", {})]),
    ("hermes", "The temperature is 26.1 <degrees> Celsius.\n", "The temperature is 26.1 <degrees> Celsius.\n", []),
    (
        "hermes",
        "Sure.\n<tool_call>\nget_weather(Paris)\n</tool_call>",
        "Sure.\n<tool_call>\nget_weather(Paris)\n</tool_call>",
        [],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": ' + json.dumps(TRICKY) + "}",
        None,
        [("search", TRICKY)],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"x": 1}}; {"parameters": {"y": [2]}, "name": "b"}',
        None,
        [("a", {"x": 1}), ("b", {"y": [2]})],
    ),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
]


def collect(deltas) -> tuple[str, list[tuple[str, str]]]:
    """The content and (name, arguments) calls a stream of DeltaMessages adds up to."""
    content, calls = "", []
    for d in deltas:
        content += d.content
        for t in d.tool_calls:
            body = t.to_openai()
            if t.index == len(calls):
                assert body["id"].startswith("chatcmpl-tool-") and body["type"] == "function"
                assert body["function"]["name"] and body["function"]["arguments"] == ""
                calls.append((body["function"]["name"], ""))
            else:
                assert set(body) == {"index", "function"} and set(body["function"]) == {"arguments"}
                name, args = calls[t.index]
                calls[t.index] = (name, args + body["function"]["arguments"])
    return content, calls


def check(parser: ToolParser, text: str, content: str | None, expected: list) -> None:
    whole = parser.extract(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == expected
    splits = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = ToolCallStream(parser)
        deltas = [stream.feed(p) for p in pieces] + [stream.feed("", final=True)]
        got_content, got_calls = collect(deltas)
        assert got_content == (content or ""), pieces
        assert [(n, json.loads(a)) for n, a in got_calls] == expected, pieces
        assert [(n, a) for n, a in got_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("name,text,content,expected", CASES)
def test_parser_whole_and_streamed(name, text, content, expected):
    check(get_tool_parser(name), text, content, expected)


def test_malformed_arguments_leave_the_text_as_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'
    whole = get_tool_parser("hermes").extract(text)
    assert (whole.content, whole.tool_calls) == (text, [])


def test_forced_shapes():
    check(
        NamedToolParser("get_weather"),
        ' {"city": "Paris", "days": [1, 2]}',
        None,
        [("get_weather", {"city": "Paris", "days": [1, 2]})],
    )
    text = '[{"name": "a", "parameters": {"x": "]"}}, {"name": "b", "parameters": {}}]'
    check(RequiredToolParser(), text, None, [("a", {"x": "]"}), ("b", {})])


def test_a_required_list_cut_by_max_tokens_keeps_its_complete_calls_whole_as_streamed():
    """tool_choice "required" cut short: the plain answer holds the calls the stream completed (it used
    to give the raw text as content and no calls)."""
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}, {"name": "a", "param'
    whole = RequiredToolParser().extract(text)
    assert whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("a", {"x": 1}), ("b", {})]
    stream = ToolCallStream(RequiredToolParser())
    _, streamed = collect([stream.feed(ch) for ch in text] + [stream.feed("", final=True)])
    assert streamed[: len(whole.tool_calls)] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert RequiredToolParser().extract('[{"name": "a", "par').content == '[{"name": "a", "par'


def test_required_schema_lists_every_function():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    schema = required_schema(tools)
    assert schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["a"], ["b"]]


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        get_tool_parser("nope")
