"""Request bodies of the pooling routes: OpenAI's /v1/embeddings, vLLM's /pooling, /score and
/rerank (Jina/Cohere's shape)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from serve.http.openai_protocol import _Request

PoolingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Request):
    """OpenAI's embeddings body; /pooling takes the same."""

    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True


class ScoreRequest(_Request):
    """vLLM's /score: text_1 against each text_2 (or pairwise, as many of each)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Request):
    """vLLM's /rerank (Jina's and Cohere's shape): documents ordered by relevance to the query."""

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)
