"""The offline API's pooling results, shaped as vLLM's (`.outputs.embedding`, `.outputs.score`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (LLM.embed)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """One pair's score (LLM.score): a cross-encoder's probability, or the embeddings' cosine."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
