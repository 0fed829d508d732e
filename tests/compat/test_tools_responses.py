"""Tool calling (and the Responses API) through real clients: the `openai` client with tools named,
required and auto (hermes and llama3_json parsers, on Qwen-style and Llama-3-style chat templates that
take tools), streamed tool-call deltas, tool results in the next turn; LangChain
`with_structured_output(method="function_calling")` and `bind_tools`; instructor in Mode.TOOLS and
Mode.JSON_SCHEMA. One server (a tiny random model) for the module; where a test needs the model to
write a call in a parser's format, a regex constraint makes it write exactly that."""

import contextlib
import json
import re
import shutil
import typing
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

import jaxinfra
from serve.http.tool_parsers import ToolConfig
from tests.serve_helpers import PRESET
from tests.server_helpers import MODEL_NAME, running_server

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"


class Weather(pydantic.BaseModel):
    """Get the weather forecast for a city."""

    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=9)


PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok_dir = tmp_path_factory.mktemp("qwen_tools_tokenizer")
    jaxinfra.load_tokenizer(PRESET).save(tok_dir)
    shutil.copy(TEMPLATES / "qwen_tools.jinja", tok_dir / "chat_template.jinja")
    with running_server(
        tokenizer=str(tok_dir), max_model_len=1024, max_num_batched_tokens=256, num_gpu_blocks_override=512
    ) as (url, app):
        app.state.server.tools = ToolConfig("hermes", enable_auto_tool_choice=True)
        yield url, app


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="none", max_retries=0)


@contextlib.contextmanager
def llama3_server(app):
    """The same server as if started with a Llama-3-style template and --tool-call-parser llama3_json."""
    state, tok = app.state.server, app.state.server.engine.tokenizer
    before = (state.tools, tok.chat_template)
    state.tools, tok.chat_template = ToolConfig("llama3_json", True), (TEMPLATES / "llama3_tools.jinja").read_text()
    try:
        yield
    finally:
        state.tools, tok.chat_template = before


def forced(text: str) -> dict:
    """extra_body that makes the model write exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_named_tool_choice_returns_a_call_with_valid_arguments(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), {**PARAMS, "additionalProperties": False})


def test_required_tool_choice_streams_one_call(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] in ("get_weather", "get_time")
    assert isinstance(json.loads(calls[0]["arguments"]), dict)


CALL_HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
CALL_LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}'


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_call(served, client, parser, stream):
    text, args = (
        (CALL_HERMES, {"city": "Paris", "days": 3}) if parser == "hermes" else (CALL_LLAMA, {"city": "Rome", "days": 2})
    )
    with llama3_server(served[1]) if parser == "llama3_json" else contextlib.nullcontext():
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=ASK,
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=120,
            stream=stream,
            extra_body={**forced(text), "skip_special_tokens": False},
        )
        if stream:
            name, arguments, content, finish = None, "", "", None
            for chunk in r:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for d in delta.tool_calls or []:
                    name = name or d.function.name
                    arguments += d.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
        else:
            message, finish = r.choices[0].message, r.choices[0].finish_reason
            content = message.content or ""
            name, arguments = message.tool_calls[0].function.name, message.tool_calls[0].function.arguments
    assert (name, json.loads(arguments), content, finish) == ("get_weather", args, "", "tool_calls")


def test_tool_none_keeps_tools_in_the_prompt_and_parses_nothing(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=100,
        extra_body={**forced(CALL_HERMES), "return_token_ids": True},
    )
    assert r.choices[0].message.content == CALL_HERMES and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_results_reach_the_next_turn(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=4, extra_body={"return_token_ids": True}
    )
    prompt = jaxinfra.load_tokenizer(PRESET).decode(r.model_extra["prompt_token_ids"])
    assert '"arguments": {"city": "Paris", "days": 3}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and '"name": "get_time"' in prompt


def test_bad_tool_requests_are_400s(served, client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}
        )
    state = served[1].state.server
    before, state.tools = state.tools, ToolConfig()
    try:
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="auto")
    finally:
        state.tools = before


def test_langchain_function_calling_and_bind_tools(served):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL_NAME, base_url=f"{served[0]}/v1", api_key="none", max_tokens=80, max_retries=0)
    weather = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Rome?")
    assert isinstance(weather, Weather)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("Weather in Rome?")
    assert message.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(message.tool_calls[0]["args"])


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_a_validated_object(client, mode):
    import instructor

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    weather = patched.chat.completions.create(
        model=MODEL_NAME, response_model=Weather, messages=ASK, max_tokens=80, max_retries=1
    )
    assert isinstance(weather, Weather)


def test_responses_plain_then_previous_response_id(served, client):
    first = client.responses.create(
        model=MODEL_NAME, input="Who begat Enos?", instructions="Answer briefly.", max_output_tokens=6, temperature=0
    )
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output[0].type == "message" and first.usage.output_tokens == 6 and first.usage.input_tokens > 0
    second = client.responses.create(
        model=MODEL_NAME, input="And then?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    prompt_with_history = second.usage.input_tokens
    alone = client.responses.create(model=MODEL_NAME, input="And then?", max_output_tokens=4, temperature=0)
    assert prompt_with_history > alone.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id="resp_unknown")


def test_responses_stream_matches_the_whole_answer(client):
    kwargs = dict(model=MODEL_NAME, input="In the beginning", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def _raw_responses(url: str, body: dict) -> tuple[dict, list[dict]]:
    """The plain body and the streamed events of one Responses call, as the server wrote them."""
    plain = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert plain.status_code == 200, plain.text
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return plain.json(), events


@pytest.mark.parametrize(
    "extra",
    [
        {"input": "In the beginning", "max_output_tokens": 8},  # cut short: incomplete
        {"input": "In the beginning", "max_output_tokens": 60, "text": {"format": {"type": "json_object"}}},
        {
            "input": "Weather?",
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
            "tool_choice": "required",
            "max_output_tokens": 60,
        },
    ],
)
def test_every_responses_object_and_event_validates_against_the_openai_types(served, extra):
    """Each body and event parses with the openai package's own pydantic types (model_validate, not the
    lenient construct the client uses): text events carry logprobs, usage its cache_write_tokens, and
    the message of an incomplete response is incomplete too."""
    from openai.types.responses import Response, ResponseStreamEvent

    body, events = _raw_responses(served[0], {"model": MODEL_NAME, "temperature": 0, **extra})
    for obj in (body, events[-1]["response"]):
        response = Response.model_validate(obj)
        assert response.usage is not None and response.usage.input_tokens_details.cache_write_tokens == 0
        for item in response.output:
            if item.type == "message":
                assert item.status == ("incomplete" if response.status == "incomplete" else "completed")
    union = typing.get_args(typing.get_args(ResponseStreamEvent)[0])
    by_type = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in union}
    for event in events:
        by_type[event["type"]].model_validate(event)
    text_events = [e for e in events if e["type"] in ("response.output_text.delta", "response.output_text.done")]
    assert all(e["logprobs"] == [] for e in text_events)
    assert Response.model_validate(body).status == events[-1]["response"]["status"]


def test_responses_json_schema_and_function_tools(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": PARAMS}
    r = client.responses.create(model=MODEL_NAME, input="Weather?", text={"format": fmt}, max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), {**PARAMS, "additionalProperties": False})
    tool = {"type": "function", "name": "get_weather", "parameters": PARAMS}
    r = client.responses.create(
        model=MODEL_NAME,
        input="Weather?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    follow = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[tool],
        max_output_tokens=3,
    )
    assert follow.status in ("completed", "incomplete")


def test_litellm_responses(served, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    r = litellm.responses(
        model=f"openai/{MODEL_NAME}",
        input="And God said",
        max_output_tokens=5,
        api_base=f"{served[0]}/v1",
        api_key="none",
    )
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0


def test_beam_search_over_http_equals_the_offline_api(served, client):
    """use_beam_search on /v1/completions gives the offline LLM.beam_search's best beams (same weights)."""
    from serve import LLM, SamplingParams

    prompt = [5, 17, 99, 3, 42]
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        n=2,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"use_beam_search": True, "best_of": 4, "length_penalty": 0.5, "return_token_ids": True},
    )
    llm = LLM(PRESET, max_model_len=64, block_size=8, max_num_seqs=8, num_gpu_blocks_override=64)
    offline = llm.generate(
        prompt, SamplingParams(use_beam_search=True, n=2, best_of=4, max_tokens=6, length_penalty=0.5, logprobs=2)
    )[0]
    assert [c.model_extra["token_ids"] for c in r.choices] == [o.token_ids for o in offline.outputs]
    for c, o in zip(r.choices, offline.outputs):  # each beam carries its tokens' logprobs (they were empty)
        assert len(c.logprobs.tokens) == len(o.token_ids) == len(c.logprobs.token_logprobs) == 6
        assert c.logprobs.token_logprobs == pytest.approx([lp[t] for lp, t in zip(o.logprobs, o.token_ids)])
        assert sum(c.logprobs.token_logprobs) == pytest.approx(o.cumulative_logprob, abs=1e-4)
        assert all(len(lp) >= 2 for lp in o.logprobs) and all(c.logprobs.top_logprobs)  # (text keys may merge)
    with pytest.raises(openai.BadRequestError, match="not streamed"):
        client.completions.create(model=MODEL_NAME, prompt="x", stream=True, extra_body={"use_beam_search": True})
