"""Per-request sampling in the engine: seeds, filters, penalties, stops, logprobs."""

import asyncio
import dataclasses

import jax
import numpy as np
import pytest

from serve import LLM, EngineArgs, SamplingParams
from serve.engine.async_engine import AsyncEngine
from tests.serve_helpers import ENGINE_DEFAULTS, engine, prompts, run

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

P = prompts([6, 20, 3, 14], seed=21)


def _gen(eng, items):
    done = run(eng, {0: [(f"r{i}", p, s) for i, (p, s) in enumerate(items)]})
    return [done[f"r{i}"] for i in range(len(items))]


def test_seeded_sample_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = _gen(engine(), [(P[1], params)])[0].outputs[0].token_ids
    mixed = (
        _gen(
            engine(),
            [
                (P[0], SamplingParams(temperature=0.7, max_tokens=15)),
                (P[1], params),
                (P[2], SamplingParams(temperature=0.0, max_tokens=4)),
            ],
        )[1]
        .outputs[0]
        .token_ids
    )
    assert alone == mixed
    other = (
        _gen(engine(), [(P[1], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=99, ignore_eos=True))])[0]
        .outputs[0]
        .token_ids
    )
    assert other != alone


def test_filters_that_collapse_to_greedy():
    eng = engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    items = [
        (P[0], greedy),
        (P[0], SamplingParams(temperature=1.5, top_k=1, max_tokens=8, seed=1, ignore_eos=True)),
        (P[0], SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, seed=2, ignore_eos=True)),
        (P[0], SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, seed=3, ignore_eos=True)),
    ]
    outs = [o.outputs[0].token_ids for o in _gen(eng, items)]
    assert outs[1] == outs[2] == outs[3] == outs[0]


def test_logprobs_are_the_models():
    import jax.numpy as jnp

    from tests.serve_helpers import model

    out = _gen(engine(), [(P[1], SamplingParams(temperature=1.0, max_tokens=3, logprobs=4, seed=5, ignore_eos=True))])[
        0
    ].outputs[0]
    seq = list(P[1])
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        lp = np.asarray(jax.nn.log_softmax(model()(jnp.asarray([seq], jnp.int32))[0, -1]))
        assert abs(entry[tok] - lp[tok]) < 1e-4
        assert len(entry) >= 4 and all(abs(v - lp[t]) < 1e-4 for t, v in entry.items())
        total += lp[tok]
        seq.append(tok)
    assert abs(out.cumulative_logprob - total) < 1e-3


def test_stop_token_ids_min_tokens_and_max_tokens():
    eng = engine()
    free = _gen(eng, [(P[3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))])[0].outputs[0]
    stop_tok = free.token_ids[2]
    first = free.token_ids.index(stop_tok)
    out = _gen(
        eng, [(P[3], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok], ignore_eos=True))]
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    held = _gen(
        eng,
        [
            (
                P[3],
                SamplingParams(
                    temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok], min_tokens=6, ignore_eos=True
                ),
            )
        ],
    )[0].outputs[0]
    assert stop_tok not in held.token_ids[:6] and len(held.token_ids) >= 6
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_stop_strings_truncate_text():
    eng = engine()
    free = _gen(eng, [(P[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])[0].outputs[0]
    text = free.text
    stop = next(c for c in text[1:] if c != "\ufffd")  # a character the byte-level model really emitted
    for include in (False, True):
        out = _gen(
            eng,
            [
                (
                    P[0],
                    SamplingParams(
                        temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True, include_stop_str_in_output=include
                    ),
                )
            ],
        )[0].outputs[0]
        cut = text.find(stop)
        assert out.text == (text[: cut + len(stop)] if include else text[:cut])
        assert out.finish_reason == "stop" and out.stop_reason == stop


def test_penalties_change_sampling():
    eng = engine()
    base = _gen(eng, [(P[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))])[0].outputs[0].token_ids
    assert len(set(base)) < len(base)  # the tiny random model repeats itself
    out = (
        _gen(
            eng,
            [
                (
                    P[2],
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=24,
                        ignore_eos=True,
                        frequency_penalty=2.0,
                        presence_penalty=2.0,
                        repetition_penalty=5.0,
                    ),
                )
            ],
        )[0]
        .outputs[0]
        .token_ids
    )
    assert out != base and len(set(out)) > len(set(base))


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("temperature", float("nan")),
        ("top_p", 0),
        ("top_k", -5),
        ("top_k", 2**31),
        ("n", 0),
        ("n", True),
        ("max_tokens", 0),
        ("max_tokens", 2**31),
        ("logprobs", 50),
        ("prompt_logprobs", -1),
        ("min_p", 2),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [2**31]),
        ("seed", 2**63),
        ("seed", 1.5),
        ("min_tokens", -1),
        ("presence_penalty", 3),
        ("repetition_penalty", 0),
        ("ignore_eos", 1),
        ("output_kind", "streaming"),
    ],
)
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_cross_field_checks():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(min_tokens=1, stop_token_ids=list(range(40)))
    assert SamplingParams(stop_token_ids=list(range(40))).stop_token_ids == list(range(40))  # no min_tokens
    assert SamplingParams(seed=2**63 - 1).device_seed == SamplingParams(seed=2**63 - 1).device_seed < 2**31
    assert SamplingParams(seed=-1).device_seed >= 0 and SamplingParams(top_k=-1).top_k == 0


def test_llm_generate_and_chat():
    llm = LLM(
        "tiny-qwen3", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=2**21, block_size=8
    )
    outs = llm.generate(["Hello there", "A"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5] and outs[0].prompt == "Hello there"
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3))
    tok = llm.get_tokenizer()
    assert chat[0].prompt_token_ids == tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)


def test_async_engine_streams_and_aborts():
    """The frontend over a core process: delta outputs add up to the whole answer; closing a stream
    aborts its request and frees its blocks; bad input is refused before anything is queued."""
    ae = AsyncEngine(EngineArgs(**ENGINE_DEFAULTS), warmup=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def main():
        whole = [out async for out in await ae.add_request("a", P[1], greedy)][-1].outputs[0]
        deltas = [
            out async for out in await ae.add_request("b", P[1], dataclasses.replace(greedy, output_kind="delta"))
        ]
        assert deltas[-1].finished and [t for d in deltas for t in d.outputs[0].token_ids] == whole.token_ids
        assert "".join(d.outputs[0].text for d in deltas) == whole.text
        long = await ae.add_request("c", P[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        async for out in long:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await long.aclose()  # consumer gone: the request is aborted and its blocks freed
        for _ in range(200):
            stats = await ae.call("stats")
            if stats.num_free_blocks == stats.num_blocks:
                break
            await asyncio.sleep(0.02)
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
        await ae.call("check_invariants")
        with pytest.raises(ValueError, match="max_model_len"):
            await ae.add_request("d", list(range(300)), SamplingParams())
        assert not ae.streams and not ae.output_processor.requests

    try:
        asyncio.run(main())
    finally:
        ae.shutdown()
