"""Speculative decoding's pieces: the config, the n-gram proposer against a plain-Python reference,
and the rejection sampler (greedy = the sequential sampler; sampled = the target's distribution)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from jax.scipy.special import gammaincc

from jaxinfra.loading import DEFAULT_MODEL, load_config
from serve import EngineArgs, SamplingParams
from serve.core.kv_cache import BlockManager
from serve.core.layout import CoreLayout
from serve.core.sampler import ROW_FIELDS, SamplingTensors, apply_penalties, sample
from serve.core.scheduler import Scheduler
from serve.core.sequence import Sequence
from serve.core.spec_decode import DraftSlots, NgramProposer, SpeculativeConfig, rejection_sample
from serve.core.spec_decode.config import AUTO_OFF_BATCH_SIZE


def tensors(n: int, **values) -> SamplingTensors:
    """n rows of sampler settings (ROW_FIELDS' padding values unless given, scalars or [n] arrays)."""
    fields = {
        name: np.broadcast_to(np.asarray(values.get(name, pad), dtype), (n,)).copy()
        for name, (dtype, pad) in ROW_FIELDS.items()
    }
    fields["out_pos"] = np.broadcast_to(np.asarray(values.get("out_pos", 0), np.int32), (n,)).copy()
    fields["stop_ids"] = np.asarray(values.get("stop_ids", np.full((n, 1), -1)), np.int32)
    return SamplingTensors(**fields)


# ---- config -------------------------------------------------------------------------------------


def test_config_takes_vllms_dict_and_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    assert c.disable_by_batch_size == AUTO_OFF_BATCH_SIZE  # the measured auto-off; None: never off
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None})
    assert c.disable_by_batch_size is None
    c = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == ("ngram", 4, 4, None)
    c = SpeculativeConfig.from_dict({"model": "tiny-llama", "num_speculative_tokens": 4})
    assert c.method == "draft_model"
    args = EngineArgs(model="tiny-llama", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert args.speculative() == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens must be"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method must be one of"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is required"),
        ({"method": "eagle", "model": "no/such/dir", "num_speculative_tokens": 2}, "speculative_config.model: "),
        ({"method": "draft_model", "model": "tiny-qwen3", "num_speculative_tokens": 2}, "has a vocabulary of 512"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min must be <= prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown field(s) ['k']"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match="EngineArgs.speculative_config") as e:
        EngineArgs(model="kjv-small-arch", speculative_config=config)  # a vocabulary of 4096
    assert message in str(e.value)


def test_the_embedded_models_draft_is_found_by_name():
    """ "default-draft" is the draft shipped beside the embedded model: same vocabulary, one layer."""
    c = SpeculativeConfig.from_dict(
        {"method": "draft_model", "model": "default-draft", "num_speculative_tokens": 3}, target_model=DEFAULT_MODEL
    )
    assert load_config(c.model).num_layers == 1 < load_config(DEFAULT_MODEL).num_layers
    from serve.http.cli_args import build_parser, engine_args_from

    spec = '{"method": "draft_model", "model": "default-draft", "num_speculative_tokens": 3}'
    argv = ["--model", "tiny-llama", "--speculative-config", spec]
    with pytest.raises(
        ValueError, match="--speculative-config.model has a vocabulary of 4096 tokens, the target's has 512"
    ):
        engine_args_from(build_parser().parse_intermixed_args(argv))


def test_speculative_config_flag_reads_json():
    from serve.http.cli_args import build_parser, engine_args_from

    argv = ["--model", "tiny-llama", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    args = engine_args_from(build_parser().parse_intermixed_args(argv))
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    bad = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}']
    with pytest.raises(ValueError, match="argument --speculative-config.num_speculative_tokens must be"):
        engine_args_from(build_parser().parse_intermixed_args(bad))


@pytest.mark.parametrize("device_proposer", [False, True])
def test_auto_off_drafts_while_few_run_and_stays_asynchronous_above(device_proposer):
    """disable_by_batch_size: above it no drafts and no host sync (the step after a step still on the
    device is scheduled at once); at or below it, drafts again, after a sync. A device proposer skips
    the steps above it, so their sequences draft no more (a gap in its cache); one admitted later does."""
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    ngram = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=2)
    proposer = DraftSlots(2) if device_proposer else NgramProposer(ngram)
    sched = Scheduler(BlockManager(64, 4), CoreLayout(8, 64, disable_spec_above=2), proposer=proposer)
    seqs = [Sequence(f"r{i}", 0, [1, 2, 3, 1, 2], params, 0) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()  # the prompts
    assert out.draft_ids is None and not out.may_draft
    assert [s.num_pending for s in seqs] == [1, 1, 1] and not sched.needs_sync()  # 3 run: speculation off
    out = sched.schedule()  # decodes of the tokens still on the device
    assert out.draft_ids is None and out.num_new.tolist() == [1, 1, 1]
    sched.remove(seqs[2])
    assert sched.needs_sync()  # 2 run: drafts come from tokens on the host
    for seq in seqs[:2]:
        seq.tokens += [3, 1]  # "3 1" occurred before: the n-gram draft is "2 3"
        seq.num_pending = 0
    out = sched.schedule()
    assert out.may_draft and sched.needs_sync()
    if not device_proposer:
        assert out.draft_ids is not None and out.draft_ids.tolist() == [[2, 3], [2, 3]]
        assert out.num_new.tolist() == [3, 3]
        return
    assert out.draft_ids is None and out.num_new.tolist() == [1, 1]  # gapped: no drafts
    sched.remove(seqs[1])
    late = Sequence("r3", 0, [4, 5, 6], params, 0)
    sched.add(late)
    seqs[0].tokens.append(9)
    seqs[0].num_pending = 0
    assert sched.schedule().num_new.tolist() == [1, 3]  # seqs[0]'s decode, the late prompt
    for seq in (seqs[0], late):
        seq.tokens.append(7)
        seq.num_pending = 0
    out = sched.schedule()
    assert out.draft_ids is not None and (out.draft_ids >= 0).sum(axis=1).tolist() == [0, 2]


# ---- n-gram proposer ----------------------------------------------------------------------------


def reference_ngram(history: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The longest suffix n-gram that occurred earlier (earliest occurrence), its next k tokens."""
    for n in range(hi, lo - 1, -1):
        if len(history) <= n:
            continue
        suffix = history[-n:]
        for s in range(len(history) - n):
            if history[s : s + n] == suffix:
                return history[s + n : s + n + k]
    return []


@pytest.mark.parametrize("lo, hi, k, vocab", [(1, 3, 4, 3), (2, 5, 3, 4), (3, 3, 5, 2), (1, 1, 2, 6)])
def test_ngram_proposer_matches_a_plain_python_reference(lo, hi, k, vocab):
    rng = np.random.default_rng(lo * 100 + hi * 10 + k)
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    )
    proposer = NgramProposer(config)
    for _ in range(20):
        b, width = 16, 40
        lengths = rng.integers(0, width + 1, b)
        tokens = np.full((b, width), 99, np.int32)  # garbage past each row's history must be ignored
        for i, n in enumerate(lengths):
            tokens[i, :n] = rng.integers(0, vocab, n)
        max_new = rng.integers(1, k + 2, b)
        drafts = proposer.propose(tokens, lengths, max_new)
        for i, n in enumerate(lengths):
            want = reference_ngram(tokens[i, :n].tolist(), lo, hi, k)[: max_new[i]]
            assert drafts[i].tolist() == want + [-1] * (k - len(want)), (tokens[i, :n], lo, hi, max_new[i])


def test_ngram_proposer_prefers_the_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=3))
    history = np.array([[5, 1, 2, 3, 7, 8, 9, 2, 3, 4, 4, 9, 2, 3]])  # "2 3" twice; "9 2 3" after 8
    assert proposer.propose(history, np.array([14])).tolist() == [[4, 4]]


# ---- rejection sampler: greedy ------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("eos_ids",))
def _spec(drafts, draft_probs, logits, t, history, is_output, eos_ids=()):
    return rejection_sample(
        drafts, draft_probs, logits, t, eos_ids=eos_ids, history=history, history_is_output=is_output
    )


def test_greedy_accepts_while_the_target_argmax_agrees_with_penalties_and_min_tokens():
    b, k, v, hist = 12, 3, 32, 6
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    logits[..., 5] += 4.0  # the favourite everywhere, until the presence penalty sees it in the history
    logits[..., 1] += 2.5  # a stop id: banned while out_pos < min_tokens
    history = rng.integers(6, v, (b, hist)).astype(np.int32)
    is_output = rng.random((b, hist)) < 0.5
    t = tensors(
        b,
        repetition=1.3,
        frequency=0.4,
        presence=4.0,
        min_tokens=2,
        out_pos=rng.integers(0, 3, b),
        stop_ids=np.full((b, 1), 1),
    )
    # The sequential sampler's greedy chain: position j sees the chain before it in its history.
    chain = np.zeros((b, k + 1), np.int32)
    for j in range(k + 1):
        h = np.concatenate([history, chain[:, :j]], axis=1)
        o = np.concatenate([is_output, np.ones((b, j), bool)], axis=1)
        tj = tensors(b, **{**_fields(t), "out_pos": np.asarray(t.out_pos) + j})
        pen = jax.jit(apply_penalties)(jnp.asarray(logits[:, j]), tj, jnp.asarray(h), jnp.asarray(o))
        chain[:, j] = np.asarray(jax.jit(sample, static_argnames="eos_ids")(pen, tj, eos_ids=(0,)).tokens)
    cut = np.arange(b) % (k + 1)  # row i's drafts go wrong at position cut[i] (k: all right)
    drafts = chain[:, :k].copy()
    for i in range(b):
        if cut[i] < k:
            drafts[i, cut[i]] = -1 if i % 2 else (chain[i, cut[i]] + 1) % v
    out = _spec(drafts, None, logits, t, history, is_output, eos_ids=(0,))
    tokens, emitted = np.asarray(out.tokens), np.asarray(out.num_emitted)
    assert emitted.tolist() == (cut + 1).tolist()
    for i in range(b):
        assert tokens[i].tolist() == chain[i, : cut[i] + 1].tolist() + [-1] * (k - cut[i])


def _fields(t: SamplingTensors) -> dict:
    return {f: np.asarray(getattr(t, f)) for f in (*ROW_FIELDS, "stop_ids")}


# ---- rejection sampler: the target's distribution -----------------------------------------------


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens with mass >= top_p, renormalised (rows of p)."""
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    out = np.where(keep, p, 0.0)
    return out / out.sum(-1, keepdims=True)


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square p-value, cells expected under 5 pooled; 0 if an impossible cell is hit."""
    if counts[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(gammaincc((len(obs) - 1) / 2, stat / 2))


@pytest.mark.parametrize("draft", ["model", "ngram"])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_first_two_tokens_follow_the_target_distribution(draft, top_p):
    n, v, real = 24_000, 24, 8  # k = 2; tokens >= real are impossible (the sampler needs v >= 20)
    rng = np.random.default_rng(1)
    impossible = np.where(np.arange(v) < real, 0.0, -np.inf)
    p0_logits = (rng.normal(size=v) * 1.5 + impossible).astype(np.float32)
    p1_logits = (rng.normal(size=(v, v)) * 1.5 + impossible).astype(np.float32)  # p(x1 | x0)
    target0, target1 = np_top_p(np_softmax(p0_logits), top_p), np_top_p(np_softmax(p1_logits), top_p)
    expected = n * target0[:, None] * target1  # joint of the first two tokens

    if draft == "model":  # a deliberately different draft model q, sampled
        q0, q1 = np_softmax(rng.normal(size=v) * 2 + impossible), np_softmax(rng.normal(size=(v, v)) * 2 + impossible)
        d0 = np.array([rng.choice(v, p=q0) for _ in range(n)])
        d1 = np.array([rng.choice(v, p=q1[a]) for a in d0])
        draft_probs = np.stack([np.broadcast_to(q0, (n, v)), q1[d0]], axis=1).astype(np.float32)
    else:  # n-gram: the same deterministic draft for every row (q one-hot)
        d0 = np.full(n, int(np.argsort(target0)[-2]))
        d1 = np.full(n, int(np.argmax(target1[d0[0]])))
        draft_probs = None
    drafts = np.stack([d0, d1], axis=1).astype(np.int32)
    logits = np.stack([np.broadcast_to(p0_logits, (n, v)), p1_logits[d0], np.zeros((n, v))], axis=1)
    t = tensors(n, temperature=1.0, top_p=top_p, seed=np.arange(n))
    out = _spec(drafts, draft_probs, logits.astype(np.float32), t, None, None)
    tokens, emitted = np.asarray(out.tokens), np.asarray(out.num_emitted)
    assert 0.05 < (emitted > 1).mean() < 0.95  # both accepting and rejecting the first draft happen
    # Rows that emitted one token take their second from the next (plain) step, as the engine would.
    t1 = tensors(n, temperature=1.0, top_p=top_p, seed=np.arange(n), out_pos=1)
    plain = np.asarray(jax.jit(sample)(jnp.asarray(p1_logits[np.maximum(tokens[:, 0], 0)]), t1).tokens)
    second = np.where(emitted >= 2, tokens[:, 1], plain)
    counts = np.zeros((v, v))
    np.add.at(counts, (tokens[:, 0], second), 1)
    assert counts[expected == 0].sum() == 0  # nothing outside the target's (top-p) support
    assert chi_square_p(counts, expected) > 1e-3
    # The test can fail: accepting every draft gives the draft's distribution, which it rejects.
    naive = np.zeros((v, v))
    np.add.at(naive, (d0, d1), 1)
    assert chi_square_p(naive, expected) < 1e-6


def test_samples_depend_on_the_row_not_the_batch():
    b, k, v = 6, 3, 32
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    drafts = rng.integers(0, v, (b, k)).astype(np.int32)
    probs = np_softmax(rng.normal(size=(b, k, v))).astype(np.float32)
    t = tensors(b, temperature=0.9, top_k=20, seed=np.arange(b) + 7, sibling=np.arange(b) % 2)
    whole = _spec(drafts, probs, logits, t, None, None)
    again = _spec(drafts, probs, logits, t, None, None)
    assert np.array_equal(whole.tokens, again.tokens)
    last = tensors(1, temperature=0.9, top_k=20, seed=b - 1 + 7, sibling=(b - 1) % 2)
    alone = _spec(drafts[-1:], probs[-1:], logits[-1:], last, None, None)
    assert np.array_equal(np.asarray(alone.tokens)[0], np.asarray(whole.tokens)[-1])


# ---- counters on /metrics -----------------------------------------------------------------------


def test_spec_decode_counters_on_metrics():
    from serve.core.spec_decode import SpecDecodingStats
    from serve.http.metrics import ServerMetrics
    from serve.types import SchedulerStats

    stats = SpecDecodingStats(3)
    stats.observe(np.array([3, 2, 0, 3]), np.array([3, 1, 0, 0]))  # three drafts, 8 tokens, 4 accepted
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.accepted_per_pos == [2, 1, 1] and stats.mean_acceptance_length == 1 + 4 / 3
    metrics = ServerMetrics("m", prefix="vllm")
    sent = msgspec.msgpack.encode(SchedulerStats(0, 0, 0.0, 0, 0, 0, 8, 8, 0, stats))  # from the core process
    metrics.observe([], msgspec.msgpack.decode(sent, type=SchedulerStats))
    stats.observe(np.array([1]), np.array([1]))
    metrics.observe([], SchedulerStats(0, 0, 0.0, 0, 0, 0, 8, 8, 0, stats))
    text = metrics.render().decode()
    for line in (
        'vllm:spec_decode_num_drafts_total{model_name="m"} 4.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0',
    ):
        assert line in text, line
