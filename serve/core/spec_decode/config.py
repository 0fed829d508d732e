"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's names and defaults, checked at start."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxinfra.loading import is_eagle_head, load_config

SPEC_METHODS = ("ngram", "draft_model", "eagle")
NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min/max when neither is given
# Speculation off above this many running requests unless the config says otherwise (None: never off).
# Measured (benchmarks/speculative.py, RESULTS.md): both proposers win at batch 1, break even at 2-4
# and lose 2-7x at 8 and above, where a verify step costs more than ~2 accepted tokens save.
AUTO_OFF_BATCH_SIZE = 4


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose tokens the target model then verifies in one step."""

    method: str
    """ngram (prompt lookup) | draft_model (a smaller model sharing the tokenizer) | eagle (a head)."""
    num_speculative_tokens: int
    """k: tokens proposed per step for each request."""
    model: str | None = None
    """The draft model or EAGLE head (directory or preset); ngram has none."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest suffix n-gram matched (default: prompt_lookup_max, else 5)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest suffix n-gram matched (default: prompt_lookup_min, else 5)."""
    disable_by_batch_size: int | None = AUTO_OFF_BATCH_SIZE
    """Propose nothing while more than this many requests run (speculation costs more than it saves);
    None: speculate at any batch size."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], target_model: str | None = None) -> SpeculativeConfig:
        """Parse vLLM's dict (method inferred from `model` as vLLM does); a bad value is a ValueError
        naming its field. With `target_model`, a draft with another vocabulary is refused."""
        if not isinstance(data, Mapping):
            raise ValueError(f"speculative_config must be a mapping, got {data!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown} (known: {sorted(names)})")
        values = dict(data)
        if values.get("method") is None:
            model = values.get("model")
            values["method"] = "ngram" if model in ("ngram", "[ngram]") else "draft_model" if model else None
        if values.get("method") == "[ngram]":
            values["method"] = "ngram"
        if values["method"] == "ngram":
            values["model"] = None
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if values["method"] == "ngram":
            values["prompt_lookup_min"] = lo if lo is not None else hi if hi is not None else NGRAM_DEFAULT
            values["prompt_lookup_max"] = hi if hi is not None else values["prompt_lookup_min"]
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        config = cls(**values)
        config.check(target_model)
        return config

    def check(self, target_model: str | None = None) -> None:
        """ValueError naming the first bad field."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name} {why}, got {getattr(self, name)!r}")

        def positive(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        if self.method not in SPEC_METHODS:
            raise bad("method", f"must be one of {', '.join(SPEC_METHODS)}")
        if not positive(self.num_speculative_tokens):
            raise bad("num_speculative_tokens", "must be a positive int")
        if self.disable_by_batch_size is not None and not positive(self.disable_by_batch_size):
            raise bad("disable_by_batch_size", "must be a positive int or None")
        if self.method == "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if not positive(getattr(self, name)):
                    raise bad(name, "must be a positive int")
            assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
            return
        if not self.model:
            raise bad("model", f"is required with method {self.method!r}")
        try:
            draft = load_config(self.model)  # the config alone, no weights read
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        head = is_eagle_head(self.model)
        if head != (self.method == "eagle"):
            raise bad("model", "is an EAGLE head: use method eagle" if head else "is not an EAGLE head directory")
        if target_model is None:
            return
        target = load_config(target_model)
        if draft.vocab_size != target.vocab_size:
            raise bad("model", f"has a vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}")
        if head and draft.hidden_size != target.hidden_size:
            raise bad("model", f"is a head of width {draft.hidden_size}, the target's is {target.hidden_size}")
