"""Structured outputs (llguidance grammars, token masks applied on device): every constrained
answer parses or matches, also when batched with unconstrained requests, which stay unchanged."""

import concurrent.futures
import json
import re

import jsonschema
import numpy as np
import openai
import pytest

from serve import SamplingParams
from serve.sampling_params import StructuredOutputsParams
from tests.serve_helpers import engine
from tests.server_helpers import MODEL_NAME, running_server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"(19|20)[0-9]{2}-[a-z]{3,5}"
CHOICES = ["And God said", "Jesus wept", "Amen"]
# One round of the mix: 5 schema, 2 regex, 2 choice, 1 JSON object, 2 unconstrained requests.
KINDS = [
    "schema",
    "regex",
    "free",
    "schema",
    "choice",
    "schema",
    "object",
    "regex",
    "schema",
    "choice",
    "free",
    "schema",
]


@pytest.fixture(scope="module")
def client():
    with running_server(max_model_len=192, max_num_seqs=16, max_num_batched_tokens=128) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _request(client: openai.OpenAI, i: int) -> tuple[str, str, str]:
    """Request i of the mix: (kind, finish_reason, text)."""
    kind = KINDS[i % len(KINDS)]
    extra: dict = {
        "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
        "regex": {"extra_body": {"guided_regex": REGEX}},
        "choice": {"extra_body": {"structured_outputs": {"choice": CHOICES}}},
        "free": {},
        "object": {"response_format": {"type": "json_object"}},
    }[kind]
    if "extra_body" not in extra:
        extra = {"extra_body": extra} if extra else {}
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": f"request {i}"}],
        max_tokens=120,
        temperature=1.0,
        seed=i,
        **extra,
    )
    return kind, r.choices[0].finish_reason, r.choices[0].message.content or ""


@pytest.mark.slow
def test_constrained_outputs_parse_under_batching(client):
    """50 JSON-schema requests at temperature 1, with regex, choice, JSON-object and unconstrained
    ones batched among them."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: _request(client, i), range(120)))
    checked = {"schema": 0, "regex": 0, "choice": 0, "object": 0}
    for kind, finish, text in results:
        if kind == "free" or (kind == "object" and finish == "length"):
            continue  # any JSON object may hold a string longer than max_tokens (random weights)
        assert finish == "stop", (kind, text)
        if kind == "schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "object":
            assert isinstance(json.loads(text), dict)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES
        checked[kind] += 1
    assert {k: checked[k] for k in ("schema", "regex", "choice")} == {"schema": 50, "regex": 20, "choice": 20}
    assert checked["object"] >= 3


@pytest.mark.slow
def test_unconstrained_neighbours_unchanged_and_bad_grammars_refused(client):
    free = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=24, temperature=0)
    alone = client.chat.completions.create(**free).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(_request, client, k) for k in (0, 1, 3, 4, 5, 7)]
        mixed = client.chat.completions.create(**free).choices[0].message.content
        assert all(f.result()[1] == "stop" for f in constrained)
    assert mixed == alone
    for body in ({"guided_regex": "(("}, {"guided_json": {"type": "nonsense"}}, {"guided_choice": []}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**free, extra_body=body)


def test_engine_masks_every_step_and_finishes_on_the_grammar():
    """In process: the sampled tokens always satisfy the grammar (greedy and random rows), and
    the request ends when the grammar does."""
    eng = engine(max_num_seqs=8)
    so = StructuredOutputsParams(regex=r"[0-9]{4}")
    prompts = [np.random.default_rng(i).integers(3, 200, 9).tolist() for i in range(6)]
    for i, prompt in enumerate(prompts):
        eng.add_request(
            f"r{i}", prompt, SamplingParams(temperature=float(i % 2), seed=i, max_tokens=30, structured_outputs=so)
        )
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    for o in done.values():
        assert re.fullmatch(r"[0-9]{4}", o.text) and o.finish_reason == "stop" and len(o.token_ids) <= 5


def test_grammar_completion_ends_the_request_even_with_ignore_eos():
    """A finished grammar ends the sequence at once (no EOS needed), also under ignore_eos and
    min_tokens; n > 1 siblings each follow their own matcher."""
    eng = engine(max_num_seqs=8)
    so = StructuredOutputsParams(choice=["alpha", "beta"])
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, min_tokens=30, structured_outputs=so
    )
    eng.add_request("c", [7, 8, 9], params)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out if out.finished else final
    assert final is not None and len(final.outputs) == 3
    for o in final.outputs:
        assert o.text in ("alpha", "beta") and o.finish_reason == "stop"
