"""The serving engine against the reference generator, under every scheduling regime."""

import numpy as np
import pytest

from serve import SamplingParams
from tests.serve_helpers import GREEDY, engine, prompts, reference, run

LENGTHS = (5, 40, 17, 3, 60, 9)


@pytest.fixture(scope="module")
def expected():
    ps = prompts(LENGTHS)
    return ps, reference(ps, GREEDY.max_tokens)


def _check(done, expected, n=1):
    _, ref = expected
    for i, r in enumerate(ref):
        out = done[f"r{i}"]
        assert len(out.outputs) == n
        for o in out.outputs:
            assert o.token_ids == r, f"request {i}"
            assert o.finish_reason == "length"


def test_staggered_arrivals(expected):
    ps, _ = expected
    eng = engine()
    arrivals = {2 * i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(ps)}
    _check(run(eng, arrivals), expected)


@pytest.mark.slow
def test_chunked_prefill_small_budget(expected):
    ps, _ = expected
    eng = engine(max_num_batched_tokens=16, max_num_seqs=4)
    _check(run(eng, {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]}), expected)


@pytest.mark.slow
def test_preemption_with_tiny_pool(expected):
    ps, _ = expected
    eng = engine(num_gpu_blocks_override=12, max_model_len=96)
    _check(run(eng, {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]}), expected)
    assert eng.core.scheduler.num_preemptions > 0


def test_n_greater_than_one_shares_prompt_blocks(expected):
    ps, _ = expected
    eng = engine()
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    done = run(eng, {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]})
    _check(done, expected, n=3)
    assert eng.core.block_manager.prefix_hits >= 2 * (60 // 8) * 8  # siblings reused the 60-token prompt's blocks


@pytest.mark.slow
def test_prefix_cache_same_outputs_and_hits():
    shared = prompts([48], seed=5)[0]
    ps = [shared + tail for tail in prompts([3, 7, 11, 1], seed=6)]
    outs = {}
    for caching in (True, False):
        eng = engine(enable_prefix_caching=caching)
        done = run(eng, {i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(ps)})
        outs[caching] = [done[f"r{i}"].outputs[0].token_ids for i in range(len(ps))]
        hits = eng.core.block_manager.prefix_hits
        assert (hits >= 3 * 48) if caching else hits == 0
        assert [done[f"r{i}"].num_cached_tokens for i in range(1, 4)] == ([48] * 3 if caching else [0] * 3)
    assert outs[True] == outs[False] == reference(ps, GREEDY.max_tokens)


@pytest.mark.slow
def test_no_recompilation_after_warmup():
    eng = engine(max_num_batched_tokens=32, max_num_seqs=8)
    eng.core.runner.warmup()
    compiled = eng.core.runner.num_compilations
    mixed = {
        i: [(f"r{i}", p, SamplingParams(temperature=0.8 * (i % 2), max_tokens=5 + 3 * i, ignore_eos=True))]
        for i, p in enumerate(prompts([3, 30, 1, 12, 25, 7, 2, 19, 4, 8]))
    }
    run(eng, mixed)
    assert eng.core.runner.num_compilations == compiled


@pytest.mark.slow
def test_randomized_workload_keeps_invariants():
    rng = np.random.default_rng(11)
    eng = engine(num_gpu_blocks_override=24, max_model_len=120, max_num_batched_tokens=24)
    shared = prompts([16], seed=3)[0]
    arrivals = {}
    for i in range(24):
        p = (shared if rng.random() < 0.5 else []) + prompts([int(rng.integers(1, 40))], seed=100 + i)[0]
        params = SamplingParams(
            n=int(rng.integers(1, 3)),
            temperature=float(rng.choice([0.0, 1.0])),
            max_tokens=int(rng.integers(1, 30)),
            seed=i,
        )
        arrivals.setdefault(int(rng.integers(0, 30)), []).append((f"r{i}", p, params))
    done, step = {}, 0
    while eng.has_unfinished_requests() or step <= 30:
        for rid, p, params in arrivals.get(step, []):
            eng.add_request(rid, p, params)
        if step % 7 == 3 and eng.unfinished_request_ids():
            eng.abort_request(sorted(eng.unfinished_request_ids())[0])
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_invariants()
        step += 1
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_blocks
    assert len(done) > 10


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(tmp_path):
    import jaxinfra
    from serve import EngineArgs, LLMEngine
    from tests.hf_oracle import make_hf_model, save_hf_model

    hf = make_hf_model("llama3_rope_scaling")
    path = save_hf_model(hf, tmp_path)
    model = jaxinfra.load_model(path)
    eng = LLMEngine(
        model,
        None,
        EngineArgs(
            model=str(path),
            block_size=8,
            max_model_len=128,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            num_gpu_blocks_override=32,
        ),
    )
    prompt = prompts([37], seed=9, vocab=300)[0]
    eng.add_request("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3, logprobs=2, temperature=0))
    out = None
    while eng.has_unfinished_requests():
        out = (eng.step() or [out])[0]
    import torch

    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert abs(entry[prompt[j]] - want[j - 1, prompt[j]]) < 1e-4
        top = np.argsort(-want[j - 1])[:3]
        assert all(abs(entry[int(t)] - want[j - 1, t]) < 1e-4 for t in top)
    generated = out.outputs[0].token_ids[0]
    assert abs(out.outputs[0].logprobs[0][generated] - want[-1, generated]) < 1e-4
    assert generated == int(np.argmax(want[-1]))


def test_rejections_name_the_problem():
    eng = engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("long", list(range(64)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        eng.add_request("oov", [1, 100000], GREEDY)
    eng.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        engine(num_gpu_blocks_override=2, max_model_len=64)
