"""The prefill cap in attention's query-key pairs (serve.core.prefill_budget): a chunk deep in a long
prompt shrinks so that the decodes beside it keep their pace, down to one token every few steps."""

import random

import pytest

from jaxinfra.config import ModelConfig
from serve import SamplingParams
from serve.config import EngineArgs
from serve.core.kv_cache import BlockManager
from serve.core.layout import CoreLayout, resolve
from serve.core.prefill_budget import UNCAPPED, pairs, tokens_within
from serve.core.scheduler import Scheduler
from serve.core.sequence import Sequence

PARAMS = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)


def test_pairs_counts_causal_attention():
    """Each of n tokens from `start` reads the keys before it and its own."""
    assert pairs(0, 1) == 1 and pairs(0, 4) == 1 + 2 + 3 + 4 and pairs(10, 3) == 11 + 12 + 13


def test_tokens_within_is_the_largest_count_that_fits():
    rng = random.Random(0)
    for _ in range(2000):
        start, n, budget = rng.randrange(0, 200_000), rng.randrange(0, 3000), rng.randrange(0, 10**7)
        m = tokens_within(start, n, budget)
        assert 0 <= m <= n and pairs(start, m) <= budget
        assert m == n or pairs(start, m + 1) > budget
    assert tokens_within(131_000, 64, UNCAPPED) == 64


def test_attention_pairs_per_token_follows_the_model():
    """Decoder matmul parameters over 2 x layers x heads x head_dim: llama-3.1-8b's is 26,625."""
    assert ModelConfig.from_preset("llama-3.1-8b").attention_pairs_per_token == 26_625
    tiny = ModelConfig.from_preset("tiny-llama-128k")
    assert tiny.attention_pairs_per_token == round(26_752 / (2 * 8))


@pytest.mark.parametrize("override,expected", [(None, 1672), (0, 0), (150, 150)])
def test_the_layout_takes_the_models_ratio_unless_told(override, expected):
    """EngineArgs.prefill_pairs_per_token: None takes the model's FLOP ratio, 0 counts tokens only."""
    cfg = ModelConfig.from_preset("tiny-llama-128k")
    args = EngineArgs(
        model="tiny-llama-128k", max_model_len=4096, num_gpu_blocks_override=300, prefill_pairs_per_token=override
    )
    assert resolve(args, cfg).pairs_per_token == expected


def _step(sched):
    """Schedule a step and make every decode's token known (as the runner's result would)."""
    out = sched.schedule()
    rows = [(s.request_id, n) for s, n in zip(out.seqs, out.num_new, strict=True)]
    for s in sched.running:
        if s.num_computed_tokens >= s.prompt_len:
            s.num_pending = 0
            s.tokens.append(7)
    return rows


@pytest.mark.parametrize("per_decode", [1, 2])
def test_a_long_prompt_shrinks_to_its_pairs_and_saves_them_below_one_token(per_decode):
    """With a decode running, a step's prompt chunk reads at most cap x pairs_per_token pairs (cap =
    per_decode x 16 tokens): a chunk from position 0 takes as many tokens as fit, deeper chunks fewer,
    and where one token reads more pairs than a step may, it runs every few steps on saved pairs; each
    step's pairs never exceed its cap plus what the steps before it saved. Nothing running: uncapped."""
    r = 2
    layout = CoreLayout(4, 64, prefill_tokens_per_decode=per_decode, pairs_per_token=r)
    sched = Scheduler(BlockManager(512, 4), layout)
    a = Sequence("a", 0, list(range(8)), PARAMS, 0, None)
    sched.add(a)
    assert _step(sched) == [("a", 8)]  # nothing runs: the whole prompt
    cap = per_decode * 16 * r
    b = Sequence("b", 1, list(range(1000, 1120)), PARAMS, 0, None)  # no prefix shared with a
    sched.add(b)
    chunks, saved, steps = [], 0, 0
    while b.num_computed_tokens < 119 and steps < 2000:  # (a last single token is a decode)
        start = b.num_computed_tokens
        rows = dict(_step(sched))
        steps += 1
        assert rows["a"] == 1  # the decode runs every step
        n = rows.get("b", 0)
        assert pairs(start, n) <= cap + saved
        assert n == tokens_within(start, per_decode * 16, cap + saved)  # as many as fit
        saved = cap + saved - pairs(start, n) if n == 0 else 0
        chunks.append(n)
    assert b.num_computed_tokens == 119
    assert chunks[0] == tokens_within(0, per_decode * 16, cap) > chunks[10] >= 1
    assert 0 in chunks  # deep in the prompt a token reads more than a step's pairs: it waits for credit
    assert sum(n == 0 for n in chunks) > sum(n > 0 for n in chunks[-20:])


def test_a_short_prompt_goes_before_the_chunks_of_a_long_one():
    """While a long prompt prefills in capped chunks, a waiting prompt that fits the step's prompt cap
    whole is admitted at once and the long prompt takes the rest of the cap, so new requests are not
    held behind every chunk of a 128K prompt; a waiting prompt longer than the cap waits its turn."""
    layout = CoreLayout(4, 64, prefill_tokens_per_decode=1)  # 16 prompt tokens a step beside decodes
    sched = Scheduler(BlockManager(512, 4), layout)
    a = Sequence("a", 0, list(range(8)), PARAMS, 0, None)
    sched.add(a)
    _step(sched)
    sched.add(Sequence("long", 1, list(range(1000, 1400)), PARAMS, 0, None))
    assert dict(_step(sched)) == {"a": 1, "long": 16}
    sched.add(Sequence("short", 2, list(range(2000, 2010)), PARAMS, 0, None))
    assert dict(_step(sched)) == {"a": 1, "long": 6, "short": 10}
    assert dict(_step(sched)) == {"a": 1, "long": 16, "short": 1}
    sched.add(Sequence("medium", 3, list(range(3000, 3020)), PARAMS, 0, None))
    assert dict(_step(sched)) == {"a": 1, "long": 16, "short": 1}
