"""Shared helpers for serving tests: a tiny model and engines built around it."""

from __future__ import annotations

import functools

import numpy as np

import jaxinfra
from serve import EngineArgs, LLMEngine, SamplingParams

PRESET = "tiny-qwen3"


@functools.lru_cache(maxsize=1)
def model():
    return jaxinfra.load_model(PRESET)


ENGINE_DEFAULTS = dict(
    model=PRESET,
    block_size=8,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    num_gpu_blocks_override=64,
)


def engine(**kwargs) -> LLMEngine:
    return LLMEngine(model(), jaxinfra.load_tokenizer(PRESET), EngineArgs(**{**ENGINE_DEFAULTS, **kwargs}))


def prompts(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def reference(prompt_list, max_tokens):
    return jaxinfra.generate(
        model(), prompt_list, jaxinfra.GenerationConfig(max_new_tokens=max_tokens, stop_at_eos=False)
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run(eng: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], check=True):
    """Step the engine; arrivals[step] are added before that step. Returns finished outputs by id."""
    done, step = {}, 0
    while eng.has_unfinished_requests() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            eng.check_invariants()
        step += 1
        assert step < 10_000
    return done
