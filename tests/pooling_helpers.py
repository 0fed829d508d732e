"""Tiny random Llama checkpoints for the pooling tests: a causal LM (embedded by mean pooling) and a
one-label LlamaForSequenceClassification cross-encoder, with the default model's tokenizer (no chat
template, a pad token)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers

from jaxinfra.loading import DEFAULT_MODEL_DIR

SHAPE = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)


def _save(model: transformers.PreTrainedModel, path: Path) -> Path:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    shutil.copy(Path(DEFAULT_MODEL_DIR) / "tokenizer.json", path / "tokenizer.json")
    special = json.loads((Path(DEFAULT_MODEL_DIR) / "tokenizer_config.json").read_text())
    special.pop("chat_template")  # plain text in: sentence-transformers would template chat-capable tokenizers
    (path / "tokenizer_config.json").write_text(json.dumps({**special, "pad_token": special["eos_token"]}))
    return path


def make_embedder(path: Path, seed: int = 0) -> Path:
    """A LlamaForCausalLM checkpoint (served with --convert embed)."""
    torch.manual_seed(seed)
    return _save(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).float().eval(), path)


def make_cross_encoder(path: Path, seed: int = 1) -> Path:
    """A one-label LlamaForSequenceClassification checkpoint (a `score` head on the last token)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE, num_labels=1)
    return _save(transformers.LlamaForSequenceClassification(config).float().eval(), path)
