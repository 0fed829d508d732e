"""Incremental detokenization and stop strings: equal to whole-sequence decoding, multi-byte safe, and
a stream never shows text that the finished answer cuts off."""

import json

import httpx
import numpy as np
import pytest

import jaxinfra
from jaxinfra.loading import DEFAULT_MODEL
from serve import SamplingParams
from serve.engine.detokenizer import IncrementalDetokenizer
from tests.server_helpers import MODEL_NAME, running_server

TEXT = "In the beginning — Héllo wörld, 你好 🎉! And God said, Let there be light: and there was light."


@pytest.fixture(scope="module")
def kjv_tokenizer():
    return jaxinfra.load_tokenizer(DEFAULT_MODEL)


def _incremental(tok, ids, params=SamplingParams(), chunks=1):
    d = IncrementalDetokenizer(tok, params)
    for i in range(0, len(ids), chunks):
        if d.add(ids[i : i + chunks]) is not None:
            break
    return d


@pytest.mark.parametrize("which", ["kjv", "byte_level"])
def test_incremental_text_equals_whole_decode(kjv_tokenizer, which):
    tok = kjv_tokenizer if which == "kjv" else jaxinfra.load_tokenizer("tiny-qwen3")
    ids = tok.encode(TEXT, add_special_tokens=False)
    for chunks in (1, 3):
        assert _incremental(tok, ids, chunks=chunks).text == tok.decode(ids) == TEXT
    rng = np.random.default_rng(0)
    for _ in range(20):  # random ids: split multi-byte characters, specials, anything
        rand = rng.integers(0, tok.vocab_size, 30).tolist()
        d = _incremental(tok, rand)
        whole = tok.decode(rand)
        assert whole.startswith(d.text) and "\ufffd" not in d.text[-1:]
        assert whole.rstrip("\ufffd") == d.text.rstrip("\ufffd") or whole[len(d.text) :].strip("\ufffd") == ""


def test_multibyte_characters_wait_until_complete():
    tok = jaxinfra.load_tokenizer("tiny-qwen3")  # byte level: one token per byte
    d = IncrementalDetokenizer(tok, SamplingParams())
    ids = tok.encode("你", add_special_tokens=False)
    assert len(ids) == 3
    seen = []
    for t in ids:
        d.add([t])
        seen.append(d.text)
    assert seen == ["", "", "你"]


def test_stop_strings_cut_and_hold_back(kjv_tokenizer):
    tok = kjv_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    for stop, include in [("light:", False), ("light:", True), ("wörld, 你", False), ("🎉!", False)]:
        params = SamplingParams(stop=[stop, "never appears"], include_stop_str_in_output=include)
        d = IncrementalDetokenizer(tok, params)
        shown, cut_at = [], None
        for j, t in enumerate(ids):
            if d.add([t]) is not None:
                cut_at = j
                break
            shown.append(d.text[: d.streamable(False)])
        end = TEXT.index(stop) + (len(stop) if include else 0)
        assert d.text == TEXT[:end] and d.stop_reason == stop and cut_at is not None
        assert all(d.text.startswith(s) for s in shown)  # nothing streamed was cut later
        assert shown[-1] == TEXT[: TEXT.index(stop)] or include  # held back: exactly the stop's start


def test_stop_strings_wait_for_min_tokens(kjv_tokenizer):
    tok = kjv_tokenizer
    ids = tok.encode("And God said, And God said", add_special_tokens=False)
    d = _incremental(tok, ids, SamplingParams(stop=["God"], min_tokens=4))
    assert d.text == "And God said, And "


def _sse(url, body):
    texts, finishes = {}, {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    if c["finish_reason"] is not None:
                        finishes.setdefault(c["index"], []).append((c["finish_reason"], c.get("stop_reason")))
    return texts, finishes


@pytest.mark.slow
def test_stream_equals_non_stream_for_stop_strings_spanning_tokens():
    with running_server(model=DEFAULT_MODEL, max_model_len=256, block_size=16, num_gpu_blocks_override=128) as (url, _):
        base = {"model": MODEL_NAME, "prompt": "And God said", "max_tokens": 40, "temperature": 0}
        full = httpx.post(f"{url}/v1/completions", json={**base, "logprobs": 0}, timeout=60).json()["choices"][0]
        text, offsets = full["text"], full["logprobs"]["text_offset"]
        stops = []
        for b in offsets[3:]:  # a stop string straddling each token boundary, first seen there
            s = text[b - 2 : b + 3]
            if len(s) == 5 and text.index(s) == b - 2 and s not in stops:
                stops.append(s)
        assert len(stops) >= 5
        for stop in stops[:8]:
            for include in (False, True):
                body = {**base, "stop": [stop], "include_stop_str_in_output": include}
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
                cut = text.index(stop) + (len(stop) if include else 0)
                assert answer["text"] == text[:cut] and answer["finish_reason"] == "stop"
                streamed, finishes = _sse(url, body)
                assert streamed == {0: answer["text"]}, stop
                assert finishes == {0: [("stop", stop)]}
        body = {**base, "n": 2, "temperature": 1.0, "seed": 3, "stop": [stops[0], " the"]}
        answers = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
        streamed, finishes = _sse(url, body)
        assert streamed == {a["index"]: a["text"] for a in answers}
        assert all(len(f) == 1 for f in finishes.values()) and set(finishes) == {0, 1}
