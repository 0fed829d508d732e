"""Training data: document sources, tokenization, packing into rows with segment ids, per-host sharding."""

from jaxinfra.data.packing import PACKED_KEYS, chunk_tokens, pack_rows
from jaxinfra.data.pipeline import DataConfig, DataLoader, unigram_entropy
from jaxinfra.data.sources import load_documents, split_documents

__all__ = ["PACKED_KEYS", "DataConfig", "DataLoader", "chunk_tokens", "load_documents", "pack_rows",
           "split_documents", "unigram_entropy"]
