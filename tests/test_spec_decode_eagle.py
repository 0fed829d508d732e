"""EAGLE speculative decoding: `jaxinfra train` fits a head over a frozen target's hidden states, and
the engine's head, run after each step on its own paged KV pool, drafts exactly what a dense
reference computes from a sequence's whole history (under batching, chunked prefill, prefix caching
and preemption), while greedy outputs stay token-identical to the engine without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxinfra import load_tokenizer
from jaxinfra.models.eagle import EagleHead, head_config, load_eagle_head, save_eagle_head
from jaxinfra.train.config import build_run_config
from jaxinfra.train.loop import train
from pallas_kernels import DenseMetadata
from serve import EngineArgs, SamplingParams
from tests.serve_helpers import PRESET, engine, model, prompts, run
from tests.test_spec_decode_engine import GREEDY, SMALL, _tokens, _workload

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

K = 3


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A head for the test model, trained by `jaxinfra train`'s recipe path on the KJV excerpt."""
    out = tmp_path_factory.mktemp("eagle")
    cfg = build_run_config(
        {
            "eagle_target": PRESET,
            "out_dir": str(out),
            "steps": 40,
            "batch_size": 4,
            "eval_every": 40,
            "eval_batches": 2,
            "log_every": 10,
            "data": {"paths": ["tests/fixtures/kjv_excerpt.txt"], "seq_len": 64, "valid_fraction": 0.1},
            "optim": {"learning_rate": 3e-3, "warmup_steps": 5},
        }
    )
    result = train(cfg, progress=False)
    return result.out_dir / "hf"


def test_jaxinfra_train_fits_an_eagle_head(head_dir):
    records = [json.loads(line) for line in (head_dir.parent / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["split"] == "train"]
    assert trained[-1]["loss"] < 0.8 * trained[0]["loss"]
    assert trained[-1]["agreement"] > trained[0]["agreement"]
    metrics = json.loads((head_dir / "metrics.json").read_text())
    assert 0.0 < metrics["eval_agreement"] <= 1.0
    head = load_eagle_head(head_dir, model().cfg)
    assert head.cfg.num_layers == 1 and head.cfg.hidden_size == model().cfg.hidden_size


def _reference_drafter(head: EagleHead, length: int):
    """Drafts from a sequence's whole history with dense attention (no KV cache, no batching): the
    target's features over tokens[:n-1], the head over them, then k greedy steps feeding its output."""
    target_def, target_state = nnx.split(model())
    head_def, head_state = nnx.split(head)
    pos = jnp.arange(length + K)[None]

    @jax.jit
    def drafts(tokens, n):
        target, head = nnx.merge(target_def, target_state), nnx.merge(head_def, head_state)
        feats, _, _ = target.hidden_states(tokens[None], pos, DenseMetadata())
        embeds = target.embed_tokens(jnp.roll(tokens, -1)[None])  # position t: x[t+1]

        def body(j, carry):
            embeds, feats, out = carry
            o, _ = head(embeds, feats, pos, DenseMetadata())
            p = n - 2 + j  # the position whose successor is the newest known (or drafted) token
            d = jnp.argmax(target.logits(o[0, p])).astype(jnp.int32)
            embeds = embeds.at[0, p + 1].set(target.embed_tokens(d[None, None])[0, 0])
            return embeds, feats.at[0, p + 1].set(o[0, p]), out.at[j].set(d)

        return jax.lax.fori_loop(0, K, body, (embeds, feats, jnp.zeros(K, jnp.int32)))[2]

    return lambda tokens: np.asarray(
        drafts(jnp.asarray(tokens + [0] * (length + K - len(tokens)), jnp.int32), len(tokens))
    ).tolist()


def _text_workload():
    """The n-gram test's workload and two Bible verses (text like the head's training: some drafts accepted)."""
    work = _workload()
    tokenizer = load_tokenizer(PRESET)
    lines = Path("tests/fixtures/kjv_excerpt.txt").read_text().splitlines()[100:102]
    work[1] = [(f"text{i}", tokenizer.encode(line)[:40], GREEDY) for i, line in enumerate(lines)]
    return work


def _repeater(directory: Path) -> Path:
    """A head that mostly drafts the token it is fed (the test model often repeats itself, so some
    drafts are accepted): fc passes the embedding, the layer's updates are damped, the target's norm."""
    target = model()
    head = EagleHead(head_config(target.cfg), nnx.Rngs(1))
    e = target.cfg.hidden_size
    head.fc[...] = jnp.concatenate([jnp.eye(e), 0.1 * head.fc[...][e:]])
    head.layer.attn.o_proj[...] = 0.5 * head.layer.attn.o_proj[...]
    head.layer.mlp.down_proj[...] = 0.5 * head.layer.mlp.down_proj[...]
    head.norm.scale[...] = target.norm.scale[...]
    save_eagle_head(head, directory)
    return directory


@pytest.fixture(scope="module")
def plain():
    """The workload's greedy tokens without speculation."""
    return _tokens(run(engine(**SMALL), _text_workload()))


@pytest.mark.parametrize("which", ["trained", "repeater"])
def test_eagle_drafts_match_a_dense_reference_and_greedy_outputs_are_identical(which, head_dir, plain, tmp_path):
    """Every step, each decode's drafts equal the dense reference's for its history; outputs equal
    the engine's without speculation; the repeater's drafts are sometimes accepted."""
    directory = head_dir if which == "trained" else _repeater(tmp_path / "repeater")
    spec = {"method": "eagle", "model": str(directory), "num_speculative_tokens": K}
    eng = engine(**SMALL, speculative_config=spec)
    reference = _reference_drafter(load_eagle_head(directory, model().cfg), SMALL["max_model_len"])
    arrivals, done, checked, step = _text_workload(), {}, 0, 0
    seen: dict[int, int] = {}
    while eng.has_unfinished_requests() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
        done.update({out.request_id: out for out in eng.step() if out.finished})
        eng.check_invariants()
        for seq in eng.core.scheduler.running:
            if seq.next_drafts and seen.get(seq.seq_id) != len(seq.tokens):
                seen[seq.seq_id] = len(seq.tokens)
                assert seq.next_drafts == reference(seq.tokens)[: len(seq.next_drafts)], seq.seq_id
                checked += 1
        step += 1
    assert checked > 20
    assert _tokens(done) == plain
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    counters = stats.spec_decoding
    assert counters is not None and counters.num_drafts > 0
    if which == "repeater":
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "eagle", "model": "default-draft"}, "speculative_config.model is not an EAGLE head directory"),
        ({"method": "draft_model", "model": "default-eagle"}, "speculative_config.model is an EAGLE head"),
    ],
)
def test_a_head_and_a_draft_model_are_not_confused(config, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="kjv-small-arch", speculative_config={**config, "num_speculative_tokens": 2})


@pytest.mark.parametrize("name, value", [("num_scheduler_steps", 4), ("tensor_parallel_size", 2)])
def test_an_eagle_head_refuses_what_it_cannot_serve_with(name, value, tmp_path):
    spec = {"method": "eagle", "model": str(_repeater(tmp_path / "head")), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=f"EngineArgs.{name} must be 1 with speculative_config.method eagle"):
        engine(**SMALL, speculative_config=spec, **{name: value})


def test_a_head_for_another_width_is_refused(tmp_path):
    narrow = EagleHead(head_config(model().cfg.replace(hidden_size=32)), nnx.Rngs(0))
    save_eagle_head(narrow, tmp_path / "narrow")
    spec = {"method": "eagle", "model": str(tmp_path / "narrow"), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model is a head of width 32, the target's is 64"):
        EngineArgs(model=PRESET, speculative_config=spec)


def test_a_resampled_step_feeds_the_head_its_own_inputs(tmp_path):
    """A request with a repetition penalty resamples its step's logits; the head still reads the step's
    packed inputs (not the resampler's), and outputs equal the engine's without speculation."""
    spec = {"method": "eagle", "model": str(_repeater(tmp_path / "head")), "num_speculative_tokens": K}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    work = {0: [("pen", prompts([20], seed=5)[0], params), ("plain", prompts([12], seed=6)[0], GREEDY)]}
    assert _tokens(run(engine(**SMALL, speculative_config=spec), work)) == _tokens(run(engine(**SMALL), work))
