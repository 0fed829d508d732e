"""The engine core's loop: async scheduling and the jitted decode loop change no output, no request
option compiles anything after warm-up, and the prefix cache never shares KV between different prompts."""

import numpy as np
import pytest

from serve import LLM, SamplingParams
from serve.core import kv_cache
from serve.core.kv_cache import BlockManager, block_hash
from serve.core.sequence import Sequence
from serve.sampling_params import StructuredOutputsParams
from tests.serve_helpers import GREEDY, engine, prompts, reference, run

LENGTHS = (5, 40, 17, 3, 60, 9)


@pytest.fixture(scope="module")
def expected():
    ps = prompts(LENGTHS)
    return ps, reference(ps, GREEDY.max_tokens)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(async_scheduling=False),
        dict(async_scheduling=True),
        dict(num_scheduler_steps=4),
        dict(num_scheduler_steps=8, max_num_batched_tokens=16, max_num_seqs=4),  # chunked prefill + loops
        dict(num_scheduler_steps=4, num_gpu_blocks_override=12, max_model_len=96),  # preemption + loops
    ],
    ids=["sync", "async", "loop4", "loop8-chunked", "loop4-preempt"],
)
def test_greedy_outputs_identical_under_async_and_decode_loops(expected, kwargs):
    ps, ref = expected
    eng = engine(**kwargs)
    preempt = "max_model_len" in kwargs  # all at once into a pool too small for them
    arrivals = (
        {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]}
        if preempt
        else {2 * i: [(f"r{i}", p, GREEDY)] for i, p in enumerate(ps)}
    )
    done = run(eng, arrivals)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(ps))] == ref
    if preempt:
        assert eng.core.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_decode_loop_stops_where_single_steps_stop(expected):
    """Stop ids, EOS after min_tokens, max_tokens and logprobs inside a decode loop match single steps."""
    ps, ref = expected
    stop_at = [r[5] for r in ref]
    items = [
        (
            f"r{i}",
            p,
            SamplingParams(
                temperature=0.0,
                max_tokens=4 + i,
                stop_token_ids=[stop_at[i]] if i % 2 else [],
                min_tokens=i % 3,
                logprobs=2,
                ignore_eos=i % 2 == 0,
            ),
        )
        for i, p in enumerate(ps)
    ]
    outs = {}
    for steps in (1, 8):
        done = run(engine(num_scheduler_steps=steps), {0: items})
        outs[steps] = [done[f"r{i}"].outputs[0] for i in range(len(ps))]
    for one, loop in zip(outs[1], outs[8]):
        assert (one.token_ids, one.finish_reason, one.stop_reason) == (
            loop.token_ids,
            loop.finish_reason,
            loop.stop_reason,
        )
        for a, b in zip(one.logprobs, loop.logprobs, strict=True):  # other shapes: other rounding
            assert a.keys() == b.keys() and np.allclose(list(a.values()), list(b.values()), atol=1e-5)
    assert {o.finish_reason for o in outs[8]} == {"stop", "length"}


@pytest.mark.slow
def test_mixed_workload_compiles_nothing_after_warmup():
    """200 requests with every option (logprobs 0-20, prompt logprobs, penalties, min_tokens with stop
    ids, n, seeds, filters, stop strings, structured outputs, logit bias), arriving over time: no compilation
    after warm-up."""
    eng = engine(max_num_batched_tokens=32, num_scheduler_steps=4)
    eng.core.runner.warmup()
    compiled = eng.core.runner.num_compilations
    rng = np.random.default_rng(7)
    arrivals: dict[int, list] = {}
    for i in range(200):
        p = prompts([int(rng.integers(1, 48))], seed=1000 + i)[0]
        params = SamplingParams(
            n=int(rng.choice([1, 1, 2, 3])),
            temperature=float(rng.choice([0.0, 0.7, 1.3])),
            top_k=int(rng.choice([0, 1, 5, 100, 600])),
            top_p=float(rng.choice([1.0, 0.9])),
            min_p=float(rng.choice([0.0, 0.05])),
            seed=int(rng.integers(0, 2**40)) if rng.random() < 0.5 else None,
            logprobs=int(rng.integers(0, 21)) if rng.random() < 0.4 else None,
            prompt_logprobs=int(rng.integers(0, 21)) if rng.random() < 0.15 else None,
            presence_penalty=float(rng.choice([0.0, 0.5])),
            frequency_penalty=float(rng.choice([0.0, 0.3])),
            repetition_penalty=float(rng.choice([1.0, 1.2])),
            min_tokens=int(rng.integers(0, 4)),
            stop_token_ids=rng.integers(0, 512, int(rng.integers(0, 4))).tolist(),
            stop=["ab"] if rng.random() < 0.1 else None,
            ignore_eos=bool(rng.random() < 0.5),
            max_tokens=int(rng.integers(4, 20)),
            structured_outputs=StructuredOutputsParams(regex="[a-z]{1,12}") if rng.random() < 0.1 else None,
            logit_bias={int(rng.integers(0, 256)): 5.0} if rng.random() < 0.1 else None,
        )
        arrivals.setdefault(int(rng.integers(0, 120)), []).append((f"m{i}", p, params))
    done = run(eng, arrivals)
    assert len(done) == 200
    assert eng.core.runner.num_compilations == compiled


@pytest.mark.slow
def test_llm_generate_leaves_nothing_queued_after_a_rejected_prompt():
    llm = LLM(
        "tiny-qwen3",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        kv_cache_memory=2**21,
        block_size=8,
    )
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1, 2, 3], list(range(100))], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4


def _seq(tokens, salt=None):
    return Sequence("r", 0, tokens, GREEDY, 0, salt)


def _computed(bm: BlockManager, seq: Sequence) -> Sequence:
    seq.num_computed_tokens = bm.allocate_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return seq


def test_prefix_keys_are_sha256_and_salted():
    key = block_hash(None, (1, 2, 3, 4), None)
    assert len(key) == 32 and key == block_hash(None, (1, 2, 3, 4), None)
    assert key != block_hash(None, (1, 2, 3, 4), "tenant-a")
    assert block_hash(key, (5, 6, 7, 8), None) != block_hash(None, (5, 6, 7, 8), None)


def test_colliding_keys_never_share_blocks(monkeypatch):
    """With every key equal, a hit must still match the block's tokens, salt and parent."""
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens, salt, adapter=0: b"same")
    bm = BlockManager(32, 4)
    a = _computed(bm, _seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    for tokens, salt, hit in [
        ([9, 9, 9, 9, 5, 6, 7, 8, 1], None, 0),  # another first block
        ([1, 2, 3, 4, 1, 2, 3, 4, 1], None, 1),  # block 2 holds block 1's tokens
        ([1, 2, 3, 4, 5, 6, 7, 8, 1], "b", 0),
    ]:  # another tenant
        other = _seq(tokens, salt)
        assert bm.allocate_prefix(other) == 4 * hit, (tokens, salt)
        assert other.block_ids == a.block_ids[:hit]
        bm.free(other)
    same = _seq([1, 2, 3, 4, 5, 6, 7, 8, 2])
    assert bm.allocate_prefix(same) == 4 and same.block_ids == a.block_ids[:1]  # only block 1 is keyed "same"
    bm.check_invariants([a, same])


def test_a_hit_needs_the_same_parent(monkeypatch):
    """Keys that ignore the parent (a collision on every block after the first): a block is still
    only shared after the very block its KV was computed behind."""
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens, salt, adapter=0: bytes(tokens))
    bm = BlockManager(32, 2)
    a = _computed(bm, _seq([1, 2, 3, 4, 9]))
    y = _computed(bm, _seq([5, 6, 3, 4, 9]))  # its [3, 4] block is not keyed: the key is taken
    z = _seq([5, 6, 3, 4, 8])
    assert bm.allocate_prefix(z) == 2 and z.block_ids == y.block_ids[:1]  # [5, 6] only, never a's [3, 4]
    bm.check_invariants([a, y, z])


@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_compiled_steps_never_copy_a_kv_pool(scan_layers):
    """Every step shape updates the donated KV pool (every layer's, stacked) in place: no copy of it,
    flattened or whole, nor of one layer's, in the compiled HLO (a copy costs a pass over the cache),
    layers scanned or unrolled; a one-token step too (XLA rewrites a one-index scatter)."""
    eng = engine(num_scheduler_steps=4, scan_layers=scan_layers)
    runner = eng.core.runner
    num_layers, blocks, *rest = runner.kv_cache.k.shape
    pools = [
        f"[{','.join(map(str, shape))}]"
        for shape in ((num_layers, blocks, *rest), (num_layers * blocks, *rest), (blocks, *rest))
    ]
    shapes = [
        runner.shapes()[0],
        runner.shapes()[-1],
        (8, 8, runner.layout.width_buckets[-1], 1),
        (1, 1, runner.layout.width_buckets[0], 1),
    ]
    batches = [runner.dummy(*shape) for shape in shapes] + [runner.dummy(8, 8, runner.layout.width_buckets[-1], 1, 4)]
    for batch in batches:
        lines = runner.compiled_text(batch).splitlines()
        copies = [line for line in lines if " copy(" in line and any(pool in line for pool in pools)]
        assert not copies, (batch.inputs.input_ids.shape, copies[:2])


_CACHE_RUN = """
import sys, time, jax
events = {"hits": 0, "misses": 0}
jax.monitoring.register_event_listener(
    lambda name, **kw: events.__setitem__("hits" if name.endswith("cache_hits") else "misses",
                                          events["hits" if name.endswith("cache_hits") else "misses"] + 1)
    if name.endswith(("cache_hits", "cache_misses")) else None)
from serve import EngineArgs, LLMEngine
eng = LLMEngine.from_engine_args(EngineArgs(model="tiny-qwen3", block_size=8, max_model_len=128, max_num_seqs=4,
                                            max_num_batched_tokens=32, num_gpu_blocks_override=64,
                                            compilation_cache_dir=sys.argv[1]))
t0 = time.perf_counter()
eng.core.runner.warmup()
print(eng.core.runner.num_compilations, events["hits"], events["misses"], time.perf_counter() - t0)
"""


@pytest.mark.slow
def test_restart_reuses_the_persistent_compilation_cache(tmp_path):
    """A second engine on the same cache directory compiles nothing: every step shape is a cache hit."""
    import subprocess
    import sys

    runs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", _CACHE_RUN, str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=600,
            env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
        )
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append([float(x) for x in r.stdout.split()[-4:]])
    (shapes, hits1, misses1, _), (shapes2, hits2, misses2, _) = runs
    assert shapes == shapes2 > 0 and misses1 >= shapes and hits1 == 0
    assert misses2 == 0 and hits2 >= shapes
    assert any((tmp_path / "cache").iterdir())


@pytest.mark.slow
def test_int8_kv_cache_through_the_engine():
    """kv_cache_dtype=int8 end to end (chunked prefill, decode loop, preemption-free pool): prompt and
    sampled-token logprobs stay within int8 quantisation error of the float cache's, and the same
    greedy tokens come out for a short horizon."""
    ps = prompts([30, 9, 17], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = {}
    for kv in ("auto", "int8"):
        done = run(
            engine(kv_cache_dtype=kv, num_scheduler_steps=4, max_num_batched_tokens=16),
            {0: [(f"r{i}", p, params) for i, p in enumerate(ps)]},
        )
        outs[kv] = [done[f"r{i}"] for i in range(len(ps))]
    for f, q in zip(outs["auto"], outs["int8"], strict=True):
        assert q.outputs[0].token_ids[:3] == f.outputs[0].token_ids[:3]
        for a, b in zip(f.prompt_logprobs[1:], q.prompt_logprobs[1:], strict=True):
            (ta, la), (tb, lb) = next(iter(a.items())), next(iter(b.items()))
            assert ta == tb and abs(la - lb) < 5e-2
        lp_f = [d[t] for d, t in zip(f.outputs[0].logprobs, f.outputs[0].token_ids)]
        lp_q = [d[t] for d, t in zip(q.outputs[0].logprobs, q.outputs[0].token_ids)]
        assert np.allclose(lp_f[:3], lp_q[:3], atol=5e-2)
