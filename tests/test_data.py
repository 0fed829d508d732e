"""Data pipeline: sources, held-out split, chunking, packing (no cross-document attention, masked
padding), shuffling and exact iterator resume."""

import json

import jax.numpy as jnp
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx

from jaxinfra.config import ModelConfig
from jaxinfra.data import DataConfig, DataLoader, chunk_tokens, load_documents, split_documents, unigram_entropy
from jaxinfra.data.pipeline import document_tokens
from jaxinfra.models import LlamaModel
from jaxinfra.tokenizer import Tokenizer
from jaxinfra.train import lm_loss

rng = np.random.default_rng(0)
WORDS = [
    "the",
    "lord",
    "said",
    "unto",
    "moses",
    "and",
    "aaron",
    "go",
    "forth",
    "into",
    "the",
    "land",
    "which",
    "i",
    "give",
    "thee",
]
DOCS = [" ".join(rng.choice(WORDS, size=int(n))) for n in rng.integers(2, 40, size=60)]


def test_text_jsonl_parquet_sources_agree(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(DOCS))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "a.parquet")
    assert load_documents([tmp_path / "a.txt"]) == DOCS
    assert load_documents([tmp_path / "a.jsonl"]) == DOCS
    assert load_documents([tmp_path / "a.parquet"], text_field="body") == DOCS
    with pytest.raises(ValueError, match="text_field"):
        load_documents([tmp_path / "a.parquet"])
    with pytest.raises(ValueError, match="text_field"):
        load_documents([tmp_path / "a.jsonl"], text_field="body")
    with pytest.raises(ValueError, match="does not exist"):
        load_documents([tmp_path / "missing.txt"])


def test_heldout_split_is_disjoint_and_spread():
    train, valid = split_documents(list(range(100)), 0.1)
    assert len(valid) == 10 and not set(train) & set(valid) and max(valid) == 99 and min(valid) == 9
    with pytest.raises(ValueError, match="valid_fraction"):
        split_documents(DOCS, 1.5)


def test_chunks_cover_every_prediction_once():
    ids = list(rng.integers(0, 100, size=53))
    pieces = chunk_tokens(ids, 16)
    assert all(len(p["inputs"]) <= 16 and len(p["inputs"]) == len(p["targets"]) for p in pieces)
    assert np.concatenate([p["inputs"] for p in pieces]).tolist() == ids[:-1]
    assert np.concatenate([p["targets"] for p in pieces]).tolist() == ids[1:]


def _loader(docs, **kw):
    batch = kw.pop("batch", 4)
    cfg = DataConfig(seq_len=kw.pop("seq_len", 24), packing_bins=3, **kw)
    return DataLoader(cfg, Tokenizer.byte_level(), batch, "valid", docs)


def test_packed_rows_hold_each_document_once_with_restarting_positions():
    """One pass over a split: the packed segments are exactly the documents' pieces, positions restart
    per segment, targets are each input's next token, and padding is masked."""
    tok = Tokenizer.byte_level()
    expected = sorted(
        tuple(p["inputs"].tolist()) + tuple(p["targets"].tolist()[-1:])
        for d in DOCS[:20]
        for p in chunk_tokens(document_tokens(tok, d), 24)
    )
    got = []
    for batch in _loader(DOCS[:20]):
        for r in range(batch["input_ids"].shape[0]):
            seg, pos = batch["segment_ids"][r], batch["positions"][r]
            assert (batch["loss_mask"][r] == (seg > 0)).all()
            for s in set(seg.tolist()) - {0}:
                idx = np.flatnonzero(seg == s)
                assert (np.diff(idx) == 1).all() and pos[idx].tolist() == list(range(len(idx)))
                inputs, targets = batch["input_ids"][r, idx], batch["targets"][r, idx]
                assert (inputs[1:] == targets[:-1]).all()
                got.append(tuple(inputs.tolist()) + (int(targets[-1]),))
    # drop_remainder may drop the last partial batch; everything packed is a real piece, each once
    assert len(got) == len(set(got)) and set(got) <= set(expected) and len(got) > 0.7 * len(expected)


def test_packing_never_attends_across_documents_and_masks_padding():
    cfg = ModelConfig(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        initializer_range=0.2,
    )
    model = LlamaModel(cfg, nnx.Rngs(1))
    batch = next(iter(_loader([d[: int(n)] for d, n in zip(DOCS[:12], rng.integers(5, 30, 12))], seq_len=64, batch=2)))
    assert (batch["segment_ids"].max(axis=1) >= 2).all() and (batch["segment_ids"] == 0).any()
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    packed = np.asarray(model(jb["input_ids"], segment_ids=jb["segment_ids"], positions=jb["positions"]))
    loss_sum, count, _ = lm_loss(model, jb)
    # every document alone, right-padded into one batch (causal: the padding after it changes nothing)
    docs = [
        (r, np.flatnonzero(batch["segment_ids"][r] == s))
        for r in range(2)
        for s in sorted(set(batch["segment_ids"][r].tolist()) - {0})
    ]
    alone_ids = np.zeros((len(docs), 64), np.int32)
    for i, (r, idx) in enumerate(docs):
        alone_ids[i, : len(idx)] = batch["input_ids"][r, idx]
    alone = np.asarray(model(jnp.asarray(alone_ids)))
    separate_sum = 0.0
    for i, (r, idx) in enumerate(docs):
        logits = alone[i, : len(idx)]
        np.testing.assert_allclose(packed[r, idx], logits, atol=1e-5)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        separate_sum -= logp[np.arange(len(idx)), batch["targets"][r, idx]].sum()
    assert float(count) == batch["loss_mask"].sum()
    np.testing.assert_allclose(float(loss_sum), separate_sum, rtol=1e-5)
    # whatever sits in the padding cannot change the loss
    pad = jb["segment_ids"] == 0
    noisy = dict(jb, input_ids=jnp.where(pad, 7, jb["input_ids"]), targets=jnp.where(pad, 9, jb["targets"]))
    np.testing.assert_allclose(float(lm_loss(model, noisy)[0]), float(loss_sum), rtol=1e-6)


def test_train_iterator_resumes_exactly_and_shuffles_by_seed():
    cfg = DataConfig(seq_len=32, packing_bins=4, shards=2)
    tok = Tokenizer.byte_level()
    loader = DataLoader(cfg, tok, 4, "train", DOCS)
    for _ in range(5):
        next(loader)
    state = loader.get_state()
    ahead = [next(loader) for _ in range(8)]  # crosses epochs of the 30-document shards
    resumed = DataLoader(cfg, tok, 4, "train", DOCS)
    resumed.set_state(state)
    for a, b in zip(ahead, [next(resumed) for _ in range(8)]):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    other_seed = DataLoader(DataConfig(seq_len=32, packing_bins=4, shards=2, shuffle_seed=1), tok, 4, "train", DOCS)
    first = next(DataLoader(cfg, tok, 4, "train", DOCS))
    assert not np.array_equal(next(other_seed)["input_ids"], first["input_ids"])
    with pytest.raises(ValueError, match="data.shards"):
        DataLoader(DataConfig(seq_len=32, shards=1), tok, 4, "train", DOCS).set_state(state)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(DataConfig(shards=3), tok, 4, "train", DOCS)
    for it in (loader, resumed, other_seed):
        it.close()


def test_unigram_entropy():
    assert unigram_entropy([[1, 2], [3, 4]]) == pytest.approx(np.log(4))
    assert unigram_entropy([[5, 5, 5]]) == 0.0
