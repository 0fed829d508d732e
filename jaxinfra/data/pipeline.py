"""The training/eval input pipeline on grain: documents -> tokens -> packed rows -> per-shard batches.

The corpus is cut into `shards` fixed streams (default: one per process). Each stream shuffles, packs and
batches its own documents; a global batch is the streams' batches stacked in order, and a process only
runs the streams whose rows its devices hold. So the global batches, and the losses, depend on the
shard count but not on how many processes share the work: 1 process x 8 devices with shards=2 sees
the same data as 2 processes x 4 devices."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import grain
import jax
import numpy as np

from jaxinfra.data.packing import chunk_tokens, pack_rows
from jaxinfra.data.sources import load_documents, split_documents
from jaxinfra.tokenizer import Tokenizer


@dataclasses.dataclass
class DataConfig:
    paths: list[str] = dataclasses.field(default_factory=list)
    format: str = "auto"  # auto (by suffix) | text | jsonl | parquet
    text_field: str = "text"  # JSONL key / Parquet column
    separator: str = "\n\n"  # document separator in text files
    valid_paths: list[str] = dataclasses.field(default_factory=list)  # held-out files; else valid_fraction
    valid_fraction: float = 0.02
    include: str = ""  # a regex: only the documents it matches at their start (e.g. one book: "Psalms ")
    seq_len: int = 256
    shuffle_seed: int = 0
    packing_bins: int = 8
    shards: int = 0  # data streams; 0 = one per process
    num_threads: int = 2  # tokenizer threads per stream
    prefetch: int = 4  # batches buffered ahead per stream

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        for name in ("packing_bins", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.shards < 0 or self.prefetch < 0:
            raise ValueError("data.shards and data.prefetch must be >= 0")
        try:
            re.compile(self.include)
        except re.error as e:
            raise ValueError(f"data.include: {self.include!r} is not a regular expression ({e})") from None


class _Chunk(grain.experimental.FlatMapTransform):
    """Tokenize a document with BOS/EOS and cut it into (inputs, targets) pieces."""

    max_fan_out = 1 << 16

    def __init__(self, tokenizer: Tokenizer, seq_len: int) -> None:
        self.tokenizer, self.seq_len = tokenizer, seq_len

    def flat_map(self, text: str) -> list[dict[str, np.ndarray]]:
        return chunk_tokens(document_tokens(self.tokenizer, text), self.seq_len)


def document_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """BOS + text + EOS: the model learns where documents start and end."""

    def special(key: str) -> list[int]:
        token = tokenizer.special_tokens.get(key)
        i = tokenizer.token_to_id(token) if token is not None else None
        return [] if i is None else [i]

    return special("bos_token") + tokenizer.encode(text, add_special_tokens=False) + special("eos_token")


def unigram_entropy(tokens: Iterable[Sequence[int]]) -> float:
    """Entropy (nats per token) of the token frequencies: the loss of the best context-free model."""
    counts: Counter[int] = Counter()
    for ids in tokens:
        counts.update(ids)
    p = np.array(list(counts.values()), np.float64)
    p /= p.sum()
    return float(-(p * np.log(p)).sum())


class DataLoader:
    """This process's rows of each global batch, with a checkpointable iterator state.

    Train split: shuffled and repeated forever. Valid split: one pass in corpus order (restart()
    begins it again), so every evaluation sees the same batches. `docs` is that split of
    split_corpus(cfg), read once by the caller for both loaders."""

    def __init__(
        self, cfg: DataConfig, tokenizer: Tokenizer, global_batch: int, split: str, docs: Sequence[str]
    ) -> None:
        if split not in ("train", "valid"):
            raise ValueError(f"split must be train or valid, got {split!r}")
        self.cfg, self.tokenizer, self.split = cfg, tokenizer, split
        self.docs = list(docs)
        if not self.docs:
            raise ValueError(f"data: the {split} split is empty (set data.valid_paths or data.valid_fraction)")
        procs, pid = jax.process_count(), jax.process_index()
        self.num_shards = cfg.shards or procs
        if self.num_shards % procs:
            raise ValueError(f"data.shards ({self.num_shards}) must be a multiple of the process count ({procs})")
        if global_batch % self.num_shards:
            raise ValueError(f"batch_size ({global_batch}) must divide evenly over data.shards ({self.num_shards})")
        if len(self.docs) < self.num_shards:
            raise ValueError(f"data: {len(self.docs)} {split} documents cannot fill {self.num_shards} shards")
        self.rows_per_shard = global_batch // self.num_shards
        per_proc = self.num_shards // procs
        self.shard_ids = list(range(pid * per_proc, (pid + 1) * per_proc))
        self.restart()

    def _dataset(self, shard: int) -> grain.IterDataset:
        ds = grain.MapDataset.source(self.docs)[shard :: self.num_shards]
        if self.split == "train":
            ds = ds.shuffle(seed=self.cfg.shuffle_seed + shard).repeat()
        pieces = grain.experimental.FlatMapIterDataset(
            ds.to_iter_dataset(grain.ReadOptions(num_threads=self.cfg.num_threads, prefetch_buffer_size=64)),
            _Chunk(self.tokenizer, self.cfg.seq_len),
        )
        batches = pack_rows(pieces, self.cfg.seq_len, self.cfg.packing_bins).batch(
            self.rows_per_shard, drop_remainder=True
        )
        if self.cfg.prefetch:
            batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=self.cfg.prefetch)
        return batches

    def restart(self) -> None:
        self.iterators = [iter(self._dataset(s)) for s in self.shard_ids]

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(it) for it in self.iterators]  # StopIteration ends a valid pass
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self) -> bytes:
        """JSON of every stream's grain state (the checkpoint's per-process data item)."""
        return json.dumps(
            {
                "num_shards": self.num_shards,
                "shards": self.shard_ids,
                "states": [it.get_state() for it in self.iterators],
            }
        ).encode()

    def set_state(self, state: bytes) -> None:
        saved: dict[str, Any] = json.loads(state)
        if saved["num_shards"] != self.num_shards or saved["shards"] != self.shard_ids:
            raise ValueError(
                f"data.shards: the checkpoint was written with {saved['num_shards']} streams "
                f"(this process: {saved['shards']}); this run has {self.num_shards} "
                f"(this process: {self.shard_ids})"
            )
        for it, s in zip(self.iterators, saved["states"]):
            it.set_state(s)

    def close(self) -> None:
        for it in self.iterators:
            close = getattr(it, "close", None)
            if close:
                close()

    def start_prefetch(self) -> None:
        """Called by grain's orbax handler after a restore; prefetch starts on the next read anyway."""


def split_corpus(cfg: DataConfig) -> dict[str, list[str]]:
    """{'train': docs, 'valid': docs} from data.paths (+ data.valid_paths or every k-th document)."""
    if not cfg.paths:
        raise ValueError("data.paths is empty: give text, JSONL or Parquet files")

    def load(paths: list[str]) -> list[str]:
        docs = load_documents(paths, cfg.format, cfg.text_field, cfg.separator)
        kept = [d for d in docs if re.match(cfg.include, d)]
        if not kept:
            raise ValueError(f"data.include: {cfg.include!r} matches none of the documents of {paths}")
        return kept

    docs = load(cfg.paths)
    if cfg.valid_paths:
        return {"train": docs, "valid": load(cfg.valid_paths)}
    train, valid = split_documents(docs, cfg.valid_fraction)
    return {"train": train, "valid": valid}
