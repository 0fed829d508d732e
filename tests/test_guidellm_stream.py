"""What guidellm's OpenAI HTTP backend sends and reads, with plain httpx: GET /health, the model from
/v1/models' first card, then streamed /v1/completions with stream_options {include_usage,
continuous_usage_stats}, ignore_eos and max_tokens, several at once; it reads `text` of choices[0],
the usage of every chunk (the last one it saw is its token count) and stops at `data: [DONE]`.
The server runs decode loops, whose tokens must still arrive one per chunk."""

import asyncio
import json

import httpx
import pytest

from tests.server_helpers import running_server

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    """With 8-step decode loops: their tokens still reach each stream one chunk at a time."""
    with running_server(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=8) as (
        url,
        _app,
    ):
        yield url


async def guidellm_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, **extra: object) -> list[dict]:
    body = {
        **extra,
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "prompt": prompt,
    }
    chunks: list[dict] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.strip():
                continue
            if line == "data: [DONE]":
                return chunks
            assert line.startswith("data:")
            chunks.append(json.loads(line[len("data:") :]))
    raise AssertionError("the stream ended without data: [DONE]")


@pytest.mark.slow
def test_guidellm_streams_finish_with_usage_on_every_chunk(server):
    assert httpx.get(f"{server}/health").status_code == 200
    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]

    async def run() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=120) as client:
            prompts = [f"request {i}: the quick brown fox" for i in range(6)]
            return await asyncio.gather(*(guidellm_request(client, server, model, p) for p in prompts))

    for chunks in asyncio.run(run()):
        *content, closing = chunks
        assert content and all("usage" in c for c in chunks)  # continuous_usage_stats: every chunk
        counts = [c["usage"]["completion_tokens"] for c in content]
        assert counts == sorted(counts) and counts[0] >= 1  # cumulative, as vLLM counts them
        assert closing["choices"] == [] and closing["usage"]["completion_tokens"] == MAX_TOKENS
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        assert all(isinstance(c["choices"][0]["text"], str) for c in content)
        (prompt_tokens,) = {c["usage"]["prompt_tokens"] for c in chunks}
        assert all(c["usage"]["total_tokens"] == c["usage"]["completion_tokens"] + prompt_tokens for c in chunks)


def test_decode_loop_tokens_arrive_one_per_chunk(server):
    """With token ids asked for (so no chunk waits for text to complete a character), every chunk of
    every stream carries exactly one new token, the last one with the finish reason."""
    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]

    async def run() -> list[list[dict]]:
        async with httpx.AsyncClient(timeout=120) as client:
            prompts = [f"stream {i}" for i in range(4)]
            return await asyncio.gather(
                *(guidellm_request(client, server, model, p, return_token_ids=True) for p in prompts)
            )

    for chunks in asyncio.run(run()):
        content = chunks[:-1]
        assert [len(c["choices"][0]["token_ids"]) for c in content] == [1] * MAX_TOKENS
        assert [c["usage"]["completion_tokens"] for c in content] == list(range(1, MAX_TOKENS + 1))
        assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (MAX_TOKENS - 1) + ["length"]
