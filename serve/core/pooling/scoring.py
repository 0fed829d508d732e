"""Score and rerank inputs and results, shared by LLM.score and the /score and /rerank routes: a
cross-encoder scores each (text_1, text_2) pair read as one prompt; an embedding model, the cosine of
the two texts' embeddings."""

from __future__ import annotations

import numpy as np

from jaxinfra.tokenizer import Tokenizer
from serve.core.pooling.vectors import cosine, sigmoid


def pair_up(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against each text_2, or text_1[i] against text_2[i]; a ValueError
    naming the field when they do not pair."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise ValueError("text_1 must not be empty")
    if not second:
        raise ValueError("text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 or as many")
    return list(zip(first, second))


def score_inputs(tok: Tokenizer, task: str, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """The prompts to pool: each pair as one sequence (the tokenizer's pair template) for a
    cross-encoder; every text_1, then every text_2, for an embedding model."""
    if task == "classify":
        return [tok.tok.encode(a, b, add_special_tokens=True).ids for a, b in pairs]
    return [tok.encode(a) for a, _ in pairs] + [tok.encode(b) for _, b in pairs]


def scores_from(task: str, outputs: list[list[float]]) -> list[float]:
    """Each pair's score from score_inputs' pooled outputs: sigmoid of a one-label classifier's logit,
    or the cosine of the two embeddings."""
    values = np.asarray(outputs, np.float32)
    if task == "classify":
        if values.shape[-1] != 1:
            raise ValueError(f"scoring needs a one-label classifier, this one has {values.shape[-1]} labels")
        return sigmoid(values[:, 0]).tolist()
    half = len(values) // 2
    return cosine(values[:half], values[half:]).tolist()
