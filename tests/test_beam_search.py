"""Beam search through the engine equals `transformers`' `generate(num_beams=4, do_sample=False)` on
random checkpoints: the same hypotheses, in the same order, with the same scores, under several
length penalties and each early-stopping rule (EOS is made likely so hypotheses do end early)."""

import asyncio

import numpy as np
import pytest
import torch

import jaxinfra
from serve import LLM, SamplingParams
from serve.engine.beam_search import BeamSearchParams, beam_search_async
from serve.types import CompletionOutput, RequestOutput
from tests.hf_oracle import make_hf_model, save_hf_model

EOS = 2
# The byte-level tokenizer saved beside the weights adds its own EOS (257): the engine stops on both.
EOS_IDS = [EOS, 257]
BEAMS = 4
MAX_NEW = 10
SETTINGS = [(1.0, False), (2.0, "never"), (0.5, True), (-1.0, False)]  # (length_penalty, early_stopping)


def make_eos_likely(model) -> None:
    """Point EOS's output row along the mean final hidden state, so EOS is often among the top few
    tokens and hypotheses end at different lengths."""
    with torch.no_grad():
        ids = torch.randint(3, 300, (4, 20), generator=torch.Generator().manual_seed(0))
        h = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        w = model.lm_head.weight
        w[EOS] = h / h.norm() * 1.0 * w.norm(dim=1).mean()


def hf_beams(model, prompt: list[int], length_penalty: float, early_stopping) -> list[tuple[list[int], float]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=BEAMS,
            num_return_sequences=BEAMS,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=EOS_IDS,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()):
        ends = [i for i, t in enumerate(seq) if t in EOS_IDS]
        beams.append((seq[: ends[0] + 1] if ends else seq, score))
    return beams


@pytest.mark.slow
@pytest.mark.parametrize("family,seed", [("llama2_mha_bias", 0), ("qwen2_bias_tied", 1), ("qwen3_qk_norm", 3)])
def test_beam_search_equals_transformers(tmp_path, family, seed):
    model = make_hf_model(family, seed=seed)
    make_eos_likely(model)
    path = save_hf_model(model, tmp_path / family)
    jaxinfra.load_tokenizer("tiny-llama").save(path)
    llm = LLM(
        str(path),
        max_model_len=64,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=96,
    )
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, n).tolist() for n in (5, 12)]
    ended_early = 0
    for length_penalty, early_stopping in SETTINGS:
        params = BeamSearchParams(BEAMS, MAX_NEW, length_penalty=length_penalty, early_stopping=early_stopping)
        for prompt, out in zip(prompts, llm.beam_search(prompts, params)):
            expected = hf_beams(model, prompt, length_penalty, early_stopping)
            assert [s.tokens for s in out.sequences] == [t for t, _ in expected], (length_penalty, early_stopping)
            np.testing.assert_allclose([s.score for s in out.sequences], [s for _, s in expected], atol=1e-4)
            ended_early += sum(s.finished for s in out.sequences)
    assert ended_early > 0  # the EOS paths were exercised
    best = llm.generate(prompts[0], SamplingParams(use_beam_search=True, n=2, best_of=BEAMS, max_tokens=MAX_NEW))[0]
    expected = hf_beams(model, prompts[0], 1.0, False)
    assert [o.token_ids for o in best.outputs] == [t for t, _ in expected[:2]]


class RecordingEngine:
    """An engine stand-in that answers every one-token beam step with two fixed candidates and
    records the options each step request carries."""

    def __init__(self) -> None:
        self.core = type("Core", (), {"info": type("Info", (), {"eos_token_ids": [EOS]})()})()
        self.tokenizer = None
        self.options: list[dict] = []

    async def add_request(self, rid, tokens, params, **options):
        self.options.append(options)

        async def stream():
            out = CompletionOutput(0, "", [5], -0.1, [{5: -0.1, 6: -0.2}], "length")
            yield RequestOutput(rid, None, tokens, None, [out], True)

        return stream()


def test_every_beam_step_carries_the_calls_tenant_weight_salt_and_priority():
    """The fair policy can only share the engine between tenants if a beam search's step requests say
    whose they are: each one carries the call's options."""
    engine = RecordingEngine()
    options = {"cache_salt": "tenant:a", "priority": 3, "tenant": "a", "weight": 2.5}
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    out = asyncio.run(beam_search_async(engine, "r", [1, 2], params, **options))
    assert len(out.sequences) == 2
    assert len(engine.options) >= 3
    assert all(o == options for o in engine.options)
    best = out.to_request_output("r", None, 1, logprobs=1).outputs[0]
    assert best.logprobs == [{5: -0.1}] * 3 and best.cumulative_logprob == pytest.approx(-0.3)
