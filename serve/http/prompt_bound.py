"""The most characters one token can stand for, when a tokenizer guarantees such a bound: then a
prompt longer than max_model_len times that many characters cannot fit, and is refused before it
is tokenized (a megabyte of text costs seconds to tokenize)."""

from __future__ import annotations

import functools
import json

from jaxinfra.tokenizer import Tokenizer

# Normalizers that never shorten text (a deleting or composing one, such as NFC or StripAccents,
# would let more characters than the bound into one token).
LENGTH_KEEPING_NORMALIZERS = frozenset({"Prepend", "Replace", "Lowercase"})


def _keeps_length(normalizer: dict | None) -> bool:
    if normalizer is None:
        return True
    if normalizer["type"] == "Sequence":
        return all(_keeps_length(n) for n in normalizer["normalizers"])
    if normalizer["type"] == "Replace":
        return bool(normalizer.get("content"))
    return normalizer["type"] in LENGTH_KEEPING_NORMALIZERS


@functools.cache
def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """A sound upper bound on the characters of text one token covers, or None if the tokenizer
    gives none: a BPE whose unknown pieces are not fused (each token is one vocabulary string, at
    least as long as the text it covers) behind a normalizer that never shortens text."""
    spec = json.loads(tokenizer.tok.to_str())
    model = spec["model"]
    if model["type"] != "BPE" or model.get("fuse_unk") or not _keeps_length(spec.get("normalizer")):
        return None
    longest_added = max((len(t["content"]) for t in spec.get("added_tokens", [])), default=1)
    return max(longest_added, *(len(piece) for piece in model["vocab"]))


def surely_too_long(tokenizer: Tokenizer | None, text: str, max_tokens: int) -> bool:
    """Whether `text` must take more than `max_tokens` tokens (False when no bound is sound)."""
    bound = max_chars_per_token(tokenizer) if tokenizer is not None else None
    return bound is not None and len(text) > max_tokens * bound
