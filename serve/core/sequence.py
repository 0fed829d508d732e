"""One generated stream: its tokens, how many of them have K/V in the cache, and its blocks."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

from serve.sampling_params import INT32_MAX, SamplingParams

if TYPE_CHECKING:  # serve.types imports the core's stats types
    from serve.types import LoRARequest

_counter = itertools.count()


STOP_EOS, STOP_ID = 1, 2  # stop codes: a token stopped its sequence as EOS, or as a stop token id (0: neither)


def stop_code(is_eos: Any, is_stop_id: Any, produced: Any, min_tokens: Any, check_eos: Any) -> Any:
    """The stop rule on token ids, for the host (Python bools and ints) and the device's decode loop
    (arrays over its rows): STOP_EOS (unless ignored) or STOP_ID once min_tokens are out, else 0."""
    eos = is_eos & check_eos
    return ((produced >= min_tokens) & (eos | is_stop_id)) * (STOP_ID - eos)


def finish_reason(token: int, code: int, at_length: bool, complete: bool = False) -> tuple[str | None, int | None]:
    """The finish rule of a sequence's new token, for the host's results and the decode loop's stream:
    (finish reason, stop token id) or (None, None). `code`: its stop code (`stop_code`); `complete`: its
    grammar is; `at_length`: it reached max_tokens or max_model_len."""
    if code:
        return "stop", None if code == STOP_EOS else token
    if complete:
        return "stop", None
    if at_length:
        return "length", None
    return None, None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """vLLM-V1 style: `num_computed_tokens` of the sequence's tokens are in the KV cache; the rest are
    computed in chunks (prompt) or one per step (decode). With asynchronous scheduling a sampled token
    may still be on the device: `num_pending` counts those, and `num_tokens` includes them. A request
    with n > 1 owns n sequences."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        cache_salt: str | None = None,
        rank: tuple[int, float] = (0, 0.0),
        tenant: str = "",
        weight: float = 1.0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """`rank`: (priority, arrival time), the order of the priority scheduling policy; `tenant` and
        its `weight`: the fair policy's share (serve.core.scheduling_policy); `lora_request`: the
        adapter it runs with (None: the base model)."""
        self.seq_id = next(_counter)
        self.request_id = request_id
        self.index = index
        self.prompt_len = len(prompt_ids)
        self.tokens: list[int] = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.cache_salt = cache_salt
        self.rank = (*rank, self.seq_id)
        self.tenant = tenant
        self.weight = weight
        self.lora_request = lora_request
        self.lora_id = lora_request.lora_int_id if lora_request is not None else 0  # 0: no adapter
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_pending = 0
        self.block_ids: list[int] = []
        self.next_drafts: list[int] = []  # EAGLE: the drafts its last step made on device for the next
        self.proposer_cache_whole = True  # every step of it ran the device proposer (its KV has no gap)
        self.block_hashes: list[bytes] = []  # keys of this sequence's full blocks, in order
        self.chain_uids: list[int] = []  # the cached block each full block's prefix resolves to (-1: none)
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None  # the stop token id (stop strings are the frontend's)
        self.prompt_logprobs: list = []
        self.started = False  # has sent an output
        self.first_scheduled: float | None = None
        self.matcher: Any = None  # structured outputs: the llguidance matcher following its output
        self.kv_transfer_params: dict[str, Any] | None = None  # disaggregation: read by the KV connector
        # the stop rules, read every step
        self.max_tokens = INT32_MAX if params.max_tokens is None else params.max_tokens
        self.min_tokens = params.min_tokens
        self.stop_ids = frozenset(params.stop_token_ids)
        self.check_eos = not params.ignore_eos

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, those still on the device included."""
        return self.num_tokens - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0

    def stop_check(
        self, token: int, eos: frozenset[int], max_model_len: int, complete: bool
    ) -> tuple[str | None, int | None]:
        """(finish reason, stop token id) after `token` was appended, or (None, None): the finish rule
        (`finish_reason`) for its counts; `complete`: its grammar is."""
        produced = len(self.tokens) - self.prompt_len
        code = stop_code(token in eos, token in self.stop_ids, produced, self.min_tokens, self.check_eos)
        return finish_reason(token, code, produced >= self.max_tokens or len(self.tokens) >= max_model_len, complete)
