"""Per-request sampling settings, with vLLM's names and meanings."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"  # cumulative: an output every step; final_only: only when finished

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an int >= 0 (0 or -1 disables)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an int >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= 20):
                raise bad(field, "must be an int in [0, 20] or None")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an int or None")
        if self.output_kind not in ("cumulative", "final_only"):
            raise bad("output_kind", "must be 'cumulative' or 'final_only'")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
