"""One generated stream: its tokens, how many of them have K/V in the cache, and its blocks."""

from __future__ import annotations

import enum
import itertools

from serve.sampling_params import SamplingParams

_counter = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """vLLM-V1 style: `num_computed_tokens` of `tokens` are in the KV cache; the rest are computed
    in chunks (prompt) or one per step (decode). A request with n > 1 owns n sequences."""

    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                 seed: int, cache_salt: str | None = None) -> None:
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.index = index
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.cache_salt = cache_salt
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # hashes of this sequence's full blocks, in order
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, float] | None] = []
        self.text = ""
        self.text_tokens = 0  # output tokens `text` was decoded from

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0
