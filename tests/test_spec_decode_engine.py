"""Speculative decoding through the engine (n-gram and draft-model proposers): greedy outputs
token-identical to the engine without it, under batching, chunked prefill, prefix caching and
preemption, and drafts accepted."""

from __future__ import annotations

import pytest

from serve import SamplingParams
from tests.serve_helpers import engine, prompts, run

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Few compiled shapes (one block-table width, three sequence buckets); 24 blocks of 8 force preemption.
SMALL = dict(max_model_len=128, max_num_seqs=4, num_gpu_blocks_override=24)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _workload():
    """Prompts that repeat themselves (n-gram drafts find matches), two sharing a long prefix (the
    second arrives after the first's prefill: prefix cache hits), one prefilled in chunks."""
    loops = [(p * 4)[:40] for p in prompts([5, 7, 3, 9], seed=1)]
    shared = prompts([48], seed=2)[0]
    long = prompts([100], seed=3)[0]
    return {
        0: [(f"r{i}", p, GREEDY) for i, p in enumerate([*loops, shared + [1, 2, 3]])],
        3: [("r5", long, GREEDY)],
        6: [("r6", shared + [4, 5], GREEDY)],
    }


def _tokens(done):
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


@pytest.fixture(scope="module")
def plain():
    return _tokens(run(engine(**SMALL), _workload()))


def test_greedy_with_ngram_speculation_is_token_identical(plain):
    """Batching, chunked prefill (64-token steps), prefix caching and preemption."""
    eng = engine(**SMALL, speculative_config=NGRAM)
    got = _tokens(run(eng, _workload()))
    assert got == plain
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    spec = stats.spec_decoding
    assert spec is not None and spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert spec.num_accepted_tokens <= spec.num_draft_tokens <= 3 * spec.num_drafts
    assert spec.accepted_per_pos[0] >= spec.accepted_per_pos[1] >= spec.accepted_per_pos[2]


@pytest.mark.parametrize("scan_layers", [True, False])
def test_greedy_with_a_draft_model_is_token_identical(plain, scan_layers):
    """Batching, chunked prefill, prefix caching and preemption with the draft on its own KV pool. The
    draft is the target itself (same preset and seed): its drafts are accepted only if its pool
    mirrors the target's, token for token. Unrolled layers (both models') match the scanned plain run."""
    spec = {"method": "draft_model", "model": "tiny-qwen3", "num_speculative_tokens": 3}
    # 22 blocks: the short prompt r6 is admitted beside r5's chunks, and the pool must still run short
    eng = engine(**{**SMALL, "num_gpu_blocks_override": 22}, speculative_config=spec, scan_layers=scan_layers)
    runner = eng.core.runner
    assert runner.proposer is not None
    assert (runner.layer_graph is not None) == (runner.proposer.device.layer_graph is not None) == scan_layers
    got = _tokens(run(eng, _workload()))
    assert got == plain
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    counters = stats.spec_decoding
    assert counters is not None and counters.num_drafts > 0
    assert counters.num_draft_tokens <= 3 * counters.num_drafts
    assert counters.num_accepted_tokens >= 0.9 * counters.num_draft_tokens


@pytest.mark.parametrize("name, value", [("num_scheduler_steps", 4), ("tensor_parallel_size", 2)])
def test_a_draft_model_refuses_what_it_cannot_serve_with(name, value):
    spec = {"method": "draft_model", "model": "tiny-qwen3", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"EngineArgs.{name} must be 1 with speculative_config.method draft_model"):
        engine(**SMALL, speculative_config=spec, **{name: value})


def test_auto_off_skips_the_draft_model_and_gapped_sequences_draft_no_more():
    """disable_by_batch_size 2: while three run the draft model is not run (no mirror dispatched);
    the two left after the first finishes have a gap in the draft's cache and draft nothing; a request
    admitted later drafts, and the draft (the target itself) agrees with every token it verifies.
    Nothing compiles after warm-up, speculating or not."""
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a, b, c, d = prompts([9, 11, 13, 10], seed=4)
    arrivals = {0: [("a", a, short), ("b", b, GREEDY), ("c", c, GREEDY)], 30: [("d", d, GREEDY)]}
    spec = {"method": "draft_model", "model": "tiny-qwen3", "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    eng = engine(**SMALL, speculative_config=spec)
    eng.core.runner.warmup()
    compiled = eng.core.runner.num_compilations
    draft = eng.core.runner.proposer
    mirrored, mirror = [], draft.mirror
    draft.mirror = lambda *args: (mirrored.append(len(eng.core.scheduler.running)), mirror(*args))[1]
    got = _tokens(run(eng, arrivals))
    assert got == _tokens(run(engine(**SMALL), arrivals))
    assert mirrored and max(mirrored) <= 2  # never with three running
    assert eng.core.runner.num_compilations == compiled
    counters = eng.stats().spec_decoding
    assert counters is not None and 0 < counters.num_drafts <= -(-GREEDY.max_tokens // 2)  # "d" alone drafts
    assert counters.num_accepted_tokens == counters.num_draft_tokens
