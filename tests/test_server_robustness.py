"""No request can hurt another: bad integers are 400s while other streams run on; a dead engine core
means 503s and error events, never hangs; the supervisor brings a new core up."""

import asyncio
import json
import os
import signal

import httpx
import pytest

from tests.server_helpers import MODEL_NAME, eventually, running_server, stream_body

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

VOCAB = 512  # tiny-qwen3

BAD = [  # (body fields, the param the 400 names)
    ({"top_k": 1099511627776}, "top_k"),
    ({"top_k": -7}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB + 3]}, None),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": -0.5}, "temperature"),
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [2**40]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
    ({"min_tokens": 1, "stop_token_ids": list(range(40))}, "stop_token_ids"),
]
GOOD = [{"seed": 2**31}, {"seed": 2**63 - 1}, {"seed": -5}, {"top_k": 10**6}]


async def _stream_tokens(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, bool]:
    """A streamed completion: (completion tokens from its usage chunk, whether it ended with [DONE])."""
    body = stream_body(max_tokens)
    tokens, done = 0, False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return tokens, done


def test_bad_integers_are_400s_while_other_streams_finish():
    with running_server(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, num_gpu_blocks_override=512) as (
        url,
        _,
    ):

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                streams = [asyncio.create_task(_stream_tokens(c, url, 600)) for _ in range(3)]
                await asyncio.sleep(0)
                results = []
                for fields, _ in BAD + [(g, None) for g in GOOD]:
                    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, **fields}
                    raw = json.dumps(body).encode()  # json.dumps keeps the lone surrogate as \\ud800
                    results.append(
                        await c.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
                    )
                    assert (await c.get(f"{url}/health")).status_code == 200
                return results, await asyncio.gather(*streams)

        results, streams = asyncio.run(main())
        for (fields, param), r in zip(BAD, results):
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"] == "invalid_request_error", fields
            if param is not None:
                assert err["param"] == param, (fields, err)
        assert [r.status_code for r in results[len(BAD) :]] == [200] * len(GOOD)
        assert streams == [(600, True)] * 3
        assert httpx.get(f"{url}/health").status_code == 200


def test_killed_core_gives_503_and_error_events():
    with running_server(max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=600) as (
        url,
        app,
    ):
        engine = app.state.server.engine
        body = {
            "model": MODEL_NAME,
            "prompt": "a long one",
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(engine.core.proc.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] == "engine_dead" and "exited" in error["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "exited" in health.json()["error"]
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 503


def test_supervisor_restarts_a_dead_core():
    with running_server(restart_on_failure=True, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64) as (
        url,
        app,
    ):
        engine = app.state.server.engine
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        old = engine.core.proc.pid
        os.kill(old, signal.SIGKILL)
        assert eventually(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=10)
        assert eventually(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=120)
        assert engine.core.proc.pid != old and engine.restarts == 1
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
