"""Training data: document sources, tokenization, packing into rows with segment ids, per-host sharding."""

from jaxinfra.data.packing import chunk_tokens, pack_rows
from jaxinfra.data.pipeline import DataConfig, DataLoader, split_corpus, unigram_entropy
from jaxinfra.data.sources import load_documents, split_documents

__all__ = [
    "DataConfig",
    "DataLoader",
    "chunk_tokens",
    "load_documents",
    "pack_rows",
    "split_corpus",
    "split_documents",
    "unigram_entropy",
]
