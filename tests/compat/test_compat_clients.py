"""Real third-party clients against our server (the embedded KJV model on a loopback port): the
official `openai` client (structured parse too), the exact bodies vLLM's and SGLang's benchmark
clients send, LangChain streaming, and lm-eval's `local-completions` loglikelihood on a small
multiple-choice task written here. Each client sends a few requests only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pydantic
import pytest

from jaxinfra.loading import DEFAULT_MODEL
from tests.server_helpers import running_server

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

NAME = "kjv-small"

# What `benchmark_serving.py` of vLLM <= 0.7 (backend vllm) and SGLang's `bench_serving`
# (backends vllm and sglang-oai-chat) post, field for field.
BENCH_BODIES = [
    (
        "/v1/completions",
        {
            "model": NAME,
            "prompt": "And God said",
            "temperature": 0.0,
            "best_of": 1,
            "max_tokens": 8,
            "logprobs": None,
            "stream": True,
            "ignore_eos": False,
        },
    ),
    (
        "/v1/completions",
        {
            "model": NAME,
            "prompt": "In the beginning",
            "temperature": 0.0,
            "best_of": 1,
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": NAME,
            "messages": [{"role": "user", "content": "Who begat Enos?"}],
            "temperature": 0.0,
            "best_of": 1,
            "max_tokens": 8,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
]


@pytest.fixture(scope="module")
def server():
    with running_server(model=DEFAULT_MODEL, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128) as (
        url,
        app,
    ):
        app.state.server.model_name = NAME
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path,body", BENCH_BODIES)
def test_benchmark_client_bodies(server, path, body):
    chunks = _sse(server, path, body)
    key = "text" if path.endswith("/completions") and "messages" not in body else None
    pieces = [
        (c["choices"][0]["text"] if key else c["choices"][0]["delta"].get("content") or "")
        for c in chunks
        if c["choices"]
    ]
    assert "".join(pieces)
    if body.get("stream_options"):
        assert chunks[-1]["usage"]["completion_tokens"] == 8


class Verse(pydantic.BaseModel):
    book: str = pydantic.Field(max_length=8)
    chapter: int = pydantic.Field(ge=1, le=150)
    amen: bool


def test_openai_client_parse_and_stream(client):
    parsed = client.chat.completions.parse(
        model=NAME,
        messages=[{"role": "user", "content": "A verse, as JSON"}],
        response_format=Verse,
        max_tokens=60,
        temperature=0.8,
        seed=1,
    )
    verse = parsed.choices[0].message.parsed
    assert isinstance(verse, Verse) and 1 <= verse.chapter <= 150
    stream = client.completions.create(model=NAME, prompt="And God said", max_tokens=12, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    full = client.completions.create(model=NAME, prompt="And God said", max_tokens=12, temperature=0)
    assert text == full.choices[0].text


def test_langchain_streaming(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="none", model=NAME, max_tokens=10, temperature=0)
    streamed = "".join(str(chunk.content) for chunk in llm.stream("And God said"))
    assert streamed and streamed == llm.invoke("And God said").content


MC_ITEMS = [
    ("In the beginning God created the", ["heaven and the earth.", "ships of Tarshish.", "north wind."]),
    ("And God said, Let there be", ["light: and there was light.", "a fish of brass.", "seven lamps."]),
    ("The LORD is my shepherd; I shall not", ["want.", "build.", "write."]),
    ("Jesus", ["wept.", "sailed to Rome.", "counted the stars."]),
]

TASK_YAML = """task: kjv_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_lm_eval_local_completions_loglikelihood(server, tmp_path):
    """lm-eval sends token-id prompts with echo, logprobs 1 and max_tokens 1, and reads the prompt
    tokens' logprobs: the accuracies it reports must be finite numbers."""
    data = tmp_path / "kjv_mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n" for q, c in MC_ITEMS))
    (tmp_path / "kjv_mc.yaml").write_text(TASK_YAML.format(data=data))
    out = tmp_path / "results"
    model_args = (
        f"model={NAME},base_url={server}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={DEFAULT_MODEL},num_concurrent=1,max_retries=1,tokenized_requests=True"
    )
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "kjv_mc",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(next(Path(out).rglob("results*.json")).read_text())["results"]["kjv_mc"]
    assert 0.0 <= results["acc,none"] <= 1.0 and 0.0 <= results["acc_norm,none"] <= 1.0


VERSE_TOOL = {
    "type": "function",
    "function": {
        "name": "find_verse",
        "description": "Find a verse",
        "parameters": {
            "type": "object",
            "properties": {"chapter": {"type": "integer", "minimum": 1, "maximum": 150}},
            "required": ["chapter"],
        },
    },
}


def test_required_tool_calls_cut_by_max_tokens_are_the_same_plain_and_streamed(client, server):
    """The embedded model loops at temperature 0, so a "required" list of calls runs to max_tokens: the
    plain answer carries every complete call, as the stream does (it used to carry the raw JSON as
    content and no calls); LangChain's tool_choice="any" (sent as "required") gets them too."""
    ask = dict(
        model=NAME,
        messages=[{"role": "user", "content": "Find verses"}],
        tools=[VERSE_TOOL],
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    plain = client.chat.completions.create(**ask).choices[0]
    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            streamed.setdefault(d.index, [d.function.name or "", ""])[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert plain.finish_reason == finish == "length"
    calls = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or []]
    complete = []
    for name, arguments in streamed.values():
        try:
            complete.append((name, json.dumps(json.loads(arguments))))
        except ValueError:
            break
    assert len(calls) >= 1 and plain.message.content is None
    assert [(n, json.dumps(json.loads(a))) for n, a in calls] == complete

    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="none", model=NAME, max_tokens=60, temperature=0)
    message = llm.bind_tools([VERSE_TOOL], tool_choice="any").invoke("Find verses")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [(n, json.loads(a)) for n, a in complete]
