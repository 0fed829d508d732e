"""128K-token prompts (issue 49 items 2-3) on the `tiny-llama-128k` preset (131,072 positions): the
engine's greedy continuation of a 131,048-token prompt, prefilled in 1,024-token chunks over paged KV,
equals the model's own forward without pages, chunks or batch (tests/long_context_reference.py); a
second question on the same document hits the prefix cache and answers in <= 5% of the first's TTFT;
a prompt past max_model_len is refused at once, offline and over HTTP (a 400 naming both numbers),
while a stream beside it runs to its end."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jax
import numpy as np
import pytest

import jaxinfra
from pallas_kernels.attention_reference import mha_reference
from serve import EngineArgs, LLMEngine, SamplingParams
from serve.core.runner.batch import SlotTable
from serve.core.sequence import Sequence
from tests.long_context_reference import causal_attention, greedy_reference
from tests.server_helpers import MODEL_NAME, running_server, stream_body

MODEL = "tiny-llama-128k"
LONGEST = 131_072  # the preset's max_position_embeddings, and the engine's max_model_len
CHUNK = 1024  # max_num_batched_tokens: the prefill's chunk
DOCUMENT = 127 * CHUNK  # 130,048 tokens: the first prompt's last chunk is its question alone
QUESTION = 1_000  # tokens: a document and a question is 131,048 tokens
GENERATE = 8  # 131,056 tokens in all, within max_model_len
GREEDY = SamplingParams(temperature=0.0, max_tokens=GENERATE, ignore_eos=True)


def long_engine(**kwargs) -> LLMEngine:
    args = dict(
        model=MODEL,
        block_size=16,
        max_model_len=LONGEST,
        max_num_seqs=4,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=LONGEST // 16 + 64,
        scan_layers=False,
    )
    return LLMEngine(jaxinfra.load_model(MODEL), None, EngineArgs(**{**args, **kwargs}))


def answer(eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], float, int]:
    """Serve one prompt alone: its tokens, its TTFT (add_request to first token, seconds), cached tokens."""
    start = time.perf_counter()
    eng.add_request(rid, prompt, GREEDY)
    ttft, out = None, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if ttft is None and o.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            out = o
    assert out is not None and out.finished and ttft is not None
    eng.check_invariants()
    return out.outputs[0].token_ids, ttft, out.num_cached_tokens


def test_the_tiled_oracle_is_dense_causal_attention():
    """The reference's tiled attention (which never holds the whole score matrix) equals the dense one."""
    q, k, v = (jax.random.normal(jax.random.key(i), (96, h, 8)) for i, h in enumerate((4, 2, 2)))
    want = mha_reference(q[None], k[None], v[None], causal=True)[0]
    np.testing.assert_allclose(causal_attention(q, k, v, tile=32), want, atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def document_answers():
    """Two questions on one 130,048-token document, served one after the other by one engine: the
    first prefills 128 chunks, the second finds the document in the prefix cache."""
    rng = np.random.default_rng(49)
    document = rng.integers(0, 512, DOCUMENT).tolist()
    prompts = [document + rng.integers(0, 512, QUESTION).tolist() for _ in range(2)]
    eng = long_engine()
    first = answer(eng, "first", prompts[0])
    compiled = eng.core.runner.num_compilations
    second = answer(eng, "second", prompts[1])
    assert eng.core.runner.num_compilations == compiled  # the second's TTFT holds no compile
    return prompts, first, second


@pytest.mark.slow
def test_128k_prompt_greedy_equals_the_unpaged_unchunked_forward(document_answers):
    prompts, (tokens, _, cached), _ = document_answers
    assert len(prompts[0]) == DOCUMENT + QUESTION == 131_048 and cached == 0
    assert tokens == greedy_reference(jaxinfra.load_model(MODEL), prompts[0], GENERATE)


@pytest.mark.slow
def test_second_question_on_the_document_hits_the_prefix_cache(document_answers):
    """Its document's 8,128 blocks come from the cache (the question's tokens are computed): the same step
    shape as the first prompt's last chunk, so nothing compiles, and TTFT <= 5% of the first's."""
    _, (_, first_ttft, _), (tokens, second_ttft, cached) = document_answers
    assert cached == DOCUMENT and len(tokens) == GENERATE
    assert second_ttft <= 0.05 * first_ttft, (second_ttft, first_ttft)


def test_prompts_past_max_model_len_are_refused_offline_naming_both_numbers():
    """The prompt's length and max_model_len are in the message; the engine then serves on, holding no
    block for the refused prompts."""
    eng = long_engine(max_num_batched_tokens=64)
    for length in (LONGEST, LONGEST + 1):
        with pytest.raises(ValueError, match=rf"prompt has {length} tokens.*max_model_len \({LONGEST}\)"):
            eng.add_request(f"long{length}", [3] * length, GREEDY)
    eng.check_invariants()
    tokens, _, _ = answer(eng, "short", list(range(40)))
    assert len(tokens) == GENERATE and not eng.unfinished_request_ids()


def test_a_kv_pool_smaller_than_max_model_len_is_refused_at_start_naming_both_numbers():
    with pytest.raises(ValueError, match=rf"{LONGEST // 16 - 1} blocks x 16 tokens.*max_model_len \({LONGEST}\)"):
        long_engine(num_gpu_blocks_override=LONGEST // 16 - 1)


@pytest.mark.slow
def test_http_refuses_prompts_past_max_model_len_with_a_400_while_a_stream_finishes():
    """Token-id prompts of 131,072 and 131,073 tokens (max_model_len 131,072) are 400s naming both
    numbers, answered while a stream runs; the stream gets all its tokens."""
    engine = dict(
        model=MODEL,
        tokenizer="tiny-llama",
        block_size=16,
        max_model_len=LONGEST,
        max_num_seqs=4,
        num_gpu_blocks_override=LONGEST // 16 + 64,
    )
    with running_server(**engine) as (url, _):

        async def main() -> tuple[list[httpx.Response], int]:
            async with httpx.AsyncClient(timeout=120) as c:
                tokens = 0
                async with c.stream("POST", f"{url}/v1/completions", json=stream_body(300)) as stream:
                    assert stream.status_code == 200
                    refusals = []
                    async for line in stream.aiter_lines():
                        if line.startswith("data: {") and not refusals:  # the stream has started
                            for length in (LONGEST, LONGEST + 1):
                                body = {"model": MODEL_NAME, "prompt": [3] * length, "max_tokens": 4}
                                refusals.append(await c.post(f"{url}/v1/completions", json=body))
                        if line.startswith("data: {"):
                            tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", tokens)
                return refusals, tokens

        refusals, tokens = asyncio.run(main())
        for length, r in zip((LONGEST, LONGEST + 1), refusals):
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert f"maximum context length is {LONGEST} tokens" in message and f"prompt has {length} tokens" in message
        assert tokens == 300
        assert httpx.get(f"{url}/health").status_code == 200


class ReadCounted(list):
    """A block list that counts the ids read through slices (what a row copy costs)."""

    read = 0

    def __getitem__(self, index):
        out = super().__getitem__(index)
        if isinstance(index, slice):
            ReadCounted.read += len(out)
        return out


def test_block_tables_grow_in_place():
    """A 128K sequence's row of the persistent block table is written as its blocks come: each step
    copies only its new block ids, so growing to 8,191 blocks reads each id once, not the table per step."""
    table = SlotTable(4, LONGEST // 16, 512)
    seq = Sequence("long", 0, [3] * 16, GREEDY, seed=0)
    seq.block_ids = ReadCounted()
    ReadCounted.read = 0
    for block in range(LONGEST // 16 - 1):
        seq.block_ids.append(block)
        (row,) = table.rows([seq]).tolist()
        table.rows([seq])  # a step that adds no block copies nothing
    assert ReadCounted.read == LONGEST // 16 - 1
    assert (table.blocks[row, : LONGEST // 16 - 1] == np.arange(LONGEST // 16 - 1)).all()
