"""Pooling models (vLLM's `--runner pooling`): embeddings, cross-encoder scores and reranking."""

from serve.core.pooling.config import PoolerConfig, PoolingSpec, pooling_spec
from serve.core.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput

__all__ = [
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolerConfig",
    "PoolingSpec",
    "ScoringOutput",
    "ScoringRequestOutput",
    "pooling_spec",
]
