"""GRPO (jaxinfra.rl): group-normalised advantages, the clipped loss with its k3 KL against a numpy
transcription, the gradient's direction on a tiny random model, and a short loop whose every update
reaches the engine through `LLM.update_weights` (outputs equal to a fresh engine on the new weights)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfra
from jaxinfra.checkpoint.hf import export_hf
from jaxinfra.rl import GRPOConfig, GRPOLearner, group_advantages, grpo_loss, pack_rollouts
from serve import LLM, SamplingParams
from tests.hf_oracle import make_hf_model, save_hf_model

ENGINE = dict(max_model_len=64, block_size=8, max_num_seqs=8, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A tiny random Llama with a tokenizer."""
    path = save_hf_model(make_hf_model("llama3_rope_scaling"), tmp_path_factory.mktemp("policy"))
    jaxinfra.load_tokenizer("tiny-llama").save(path)
    return str(path)


def test_advantages_are_normalised_within_each_group():
    rng = np.random.default_rng(0)
    rewards = np.concatenate([rng.normal(3.0, 2.0, (3, 8)), np.full((1, 8), 0.7)])
    adv = group_advantages(rewards)
    np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-5)
    np.testing.assert_allclose(adv[:3].std(axis=1), 1.0, atol=1e-3)
    np.testing.assert_array_equal(adv[3], 0.0)  # all equal: no signal, and no division by zero
    np.testing.assert_allclose(group_advantages(np.array([[0.0, 1.0]])), [[-1.0, 1.0]], atol=1e-3)
    with pytest.raises(ValueError, match=r"rewards must be \[groups, samples\]"):
        group_advantages(np.ones(4))


def numpy_grpo_loss(logp, old, ref, adv, mask, eps, beta):
    """The GRPO objective written out per completion, token by token."""
    per_seq, kls = [], []
    for i in range(logp.shape[0]):
        terms, kl_terms = [], []
        for t in np.flatnonzero(mask[i]):
            ratio = np.exp(logp[i, t] - old[i, t])
            clipped = min(max(ratio, 1 - eps), 1 + eps)
            kl = np.exp(ref[i, t] - logp[i, t]) - (ref[i, t] - logp[i, t]) - 1
            terms.append(-(min(ratio * adv[i], clipped * adv[i]) - beta * kl))
            kl_terms.append(kl)
        per_seq.append(np.mean(terms))
        kls.append(np.mean(kl_terms))
    return np.mean(per_seq), np.mean(kls)


def test_loss_matches_a_numpy_transcription():
    rng = np.random.default_rng(1)
    b, t = 6, 9
    logp = -rng.uniform(0.1, 4.0, (b, t))
    old = logp + rng.normal(0, 0.4, (b, t))  # ratios inside and outside 1 +- 0.2
    ref = logp + rng.normal(0, 0.5, (b, t))
    adv = rng.normal(size=b)
    mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float32)
    mask[:, 0] = 1.0
    loss, metrics = grpo_loss(*map(jnp.asarray, (logp, old, ref, adv, mask)), clip_eps=0.2, kl_coef=0.1)
    want_loss, want_kl = numpy_grpo_loss(logp, old, ref, adv, mask, 0.2, 0.1)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5)
    assert 0.0 < float(metrics["clip_fraction"]) < 1.0


def test_kl_is_zero_when_the_policy_is_the_reference():
    rng = np.random.default_rng(2)
    logp = jnp.asarray(-rng.uniform(0.1, 4.0, (4, 5)))
    _, metrics = grpo_loss(logp, logp, logp, jnp.ones(4), jnp.ones((4, 5)), clip_eps=0.2, kl_coef=1.0)
    assert float(metrics["kl"]) == 0.0
    _, moved = grpo_loss(logp, logp, logp - 0.3, jnp.ones(4), jnp.ones((4, 5)), clip_eps=0.2, kl_coef=1.0)
    assert float(moved["kl"]) > 0.0


def test_pack_rollouts_masks_the_completion_tokens():
    tokens, mask = pack_rollouts([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], length=6, pad_id=0)
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 9, 10, 0], [8, 11, 12, 13, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 0], [1, 1, 1, 0, 0]])  # position t predicts t + 1
    with pytest.raises(ValueError, match="over length=4"):
        pack_rollouts([[5, 6, 7]], [[9, 10]], length=4)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        pack_rollouts([[]], [[9]], length=4)
    with pytest.raises(ValueError, match="GRPOConfig.clip_eps must be > 0"):
        GRPOConfig(clip_eps=0.0)


def test_an_update_raises_the_log_prob_of_positive_advantage_completions(checkpoint):
    learner = GRPOLearner(jaxinfra.load_model(checkpoint), GRPOConfig(learning_rate=1e-3))
    tokens, mask = pack_rollouts([[5, 17, 99]] * 4, [[40, 41, 42], [50, 51, 52], [60, 61], [70]], length=8)
    adv = group_advantages(np.array([[1.0, 0.0, 1.0, 0.0]]))[0]
    before = learner.logprobs(tokens)
    metrics = learner.update(tokens, mask, adv, before)
    assert metrics["kl"] == 0.0 and metrics["clip_fraction"] == 0.0  # the first step: policy == old == reference
    change = ((learner.logprobs(tokens) - before) * mask).sum(axis=1)
    assert change[0] > 0 and change[2] > 0, change
    assert change[1] < 0 and change[3] < 0, change


@pytest.mark.slow
def test_a_short_loop_syncs_every_update_into_the_engine(checkpoint, tmp_path):
    """Rollouts (n per prompt) from the engine, a rule's rewards, an update, update_weights: the next
    rollouts' sampled log-probs are the updated policy's, and greedy outputs equal a fresh engine's."""
    llm = LLM(checkpoint, **ENGINE)
    learner = GRPOLearner(jaxinfra.load_model(checkpoint), GRPOConfig(learning_rate=3e-2))
    prompts = [[5, 17, 99, 3], [8, 9, 10]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for it in range(2):
        sampling = SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=it, logprobs=0)
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        rewards = np.array([[float(np.mean(np.array(c.token_ids) < 150)) for c in o.outputs] for o in outs])
        rows = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
        tokens, mask = pack_rollouts([p for p, _ in rows], [c.token_ids for _, c in rows], length=12)
        old = learner.logprobs(tokens)
        np.testing.assert_allclose((old * mask).sum(axis=1), [c.cumulative_logprob for _, c in rows], atol=1e-3)
        learner.update(tokens, mask, group_advantages(rewards).reshape(-1), old)
        llm.update_weights(learner.params)
    trained = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert trained != first  # the updates moved the engine's outputs
    fresh_dir = export_hf(learner.model(), tmp_path / "trained")
    jaxinfra.load_tokenizer("tiny-llama").save(fresh_dir)
    fresh = LLM(str(fresh_dir), **ENGINE)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy, use_tqdm=False)] == trained
