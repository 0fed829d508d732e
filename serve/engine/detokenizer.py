"""Incremental detokenization: O(new tokens) per step, multi-byte characters held until complete,
stop strings looked for in the new text only, and a hold-back so streams never show text that a
stop string will cut."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from jaxinfra.tokenizer import Tokenizer
from serve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """The text of one growing output. `add` returns where a stop string matched, if one did."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.num_tokens = 0
        self.stop_reason: str | None = None

    def add(self, token_ids: list[int]) -> int | None:
        """Append tokens' text. If a stop string completes, cut the text there and return the index
        (in token_ids) of the token that completed it; the tokens after it are not part of the output."""
        for j, token in enumerate(token_ids):
            self.num_tokens += 1
            if self.tokenizer is None:
                continue
            try:
                piece = self.stream.step(self.tokenizer.tok, token)
            except Exception:  # an id beyond the tokenizer's vocabulary (a padded embedding): no text
                piece = None
            if not piece:
                continue
            text, self.text = self.text, ""
            before = len(text)
            text += piece  # the only reference: CPython grows the string in place (O(new text))
            self.text = text
            if self.stop and self.num_tokens >= self.min_tokens and self._find_stop(before):
                return j
        return None

    def _find_stop(self, before: int) -> bool:
        """Look for a stop string that ends in the new text; cut the text at the earliest."""
        start = max(0, before - self.max_stop + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def streamable(self, finished: bool) -> int:
        """How much of `text` may be shown now: all of it once finished; before that, all but a
        suffix that could still grow into a stop string (which would be cut)."""
        if finished or not self.stop or self.include_stop:
            return len(self.text)
        for k in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return len(self.text) - k
        return len(self.text)
