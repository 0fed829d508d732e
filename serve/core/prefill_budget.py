"""How many prompt tokens a step may take beside running decodes (EngineArgs.prefill_tokens_per_decode),
counted in tokens and in attention's query-key pairs."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from serve.core.runner.sizing import fit

if TYPE_CHECKING:
    from serve.core.sequence import Sequence

MIN_COUNTED = 16  # running sequences counted at least: small batches still admit a prompt chunk a step
UNCAPPED = 1 << 62  # query-key pairs when they are not counted


def pairs(start: int, n: int) -> int:
    """Query-key pairs of causal attention for `n` prompt tokens from position `start` (each reads the
    keys before it and itself)."""
    return n * start + n * (n + 1) // 2


def tokens_within(start: int, n: int, budget: int) -> int:
    """The most of `n` prompt tokens from position `start` whose attention fits `budget` pairs."""
    if pairs(start, n) <= budget:
        return n
    b = start + 0.5  # pairs(start, m) = m * b + m * m / 2: the positive root, then exact integer steps
    m = min(int(math.sqrt(b * b + 2 * budget) - b), n)
    while m > 0 and pairs(start, m) > budget:
        m -= 1
    while m < n and pairs(start, m + 1) <= budget:
        m += 1
    return m


def held_for(head: Sequence | None, prefill: int) -> tuple[int, int]:
    """(tokens, pairs) that a running prompt which cannot finish in this step leaves to `head`, the
    waiting prompt that may join next (None: none may), when its whole prompt fits the step's `prefill`
    tokens: short prompts do not wait behind every chunk of a long one (vLLM's
    max_long_partial_prefills); else (0, 0)."""
    if head is None or head.num_pending:
        return 0, 0
    start = head.num_computed_tokens
    n = head.num_tokens - start
    return (n, pairs(start, n)) if n <= prefill else (0, 0)


@dataclasses.dataclass
class PrefillBudget:
    """While sequences run, a step's prompt tokens are capped at `per_decode` per running sequence, then
    stretched to fill the token bucket the step pads to anyway (padding costs what tokens cost);
    `per_decode` 0 (or nothing running) leaves the whole step budget to prompts, as vLLM does.

    The cap also holds in attention: a step's prompt chunks may read at most cap x `pairs_per_token`
    query-key pairs (the pairs whose FLOPs equal one token's matmuls), so a chunk deep in a long prompt,
    whose tokens each read every key before them, shrinks instead of stalling the decodes beside it.
    Where one token's pairs exceed a step's, the steps that could not take it save their pairs
    (`credit`) until one can."""

    max_num_batched_tokens: int
    per_decode: int = 0
    token_buckets: tuple[int, ...] = ()  # the steps' (CoreLayout's)
    pairs_per_token: int = 0  # the model's (CoreLayout's); 0: pairs are not counted
    credit: int = 0  # pairs saved by steps whose pairs could not buy a prompt token

    def cap(self, running: int) -> int:
        """Prompt tokens a step may take with `running` sequences running."""
        if not self.per_decode or not running:
            return self.max_num_batched_tokens
        return self.per_decode * max(running, MIN_COUNTED)

    def pair_cap(self, running: int) -> int:
        """Query-key pairs a step's prompt chunks may read with `running` sequences running (saved
        credit included)."""
        if not self.per_decode or not running or not self.pairs_per_token:
            return UNCAPPED
        return self.cap(running) * self.pairs_per_token + self.credit

    def settle(self, left: int, starved: bool) -> None:
        """After a step: keep its unspent pairs as credit if a prompt chunk got no token for want of
        pairs (it is less than that token's pairs, so no burst builds), else start afresh."""
        self.credit = left if starved else 0  # only a capped step starves

    def fill(self, used: int, prefill: int) -> int:
        """Prompt tokens waiting prompts may add to a step that holds `used` tokens and has `prefill` of
        its cap left: the rest of the cap, up to the end of the token bucket the step pads to."""
        if not self.token_buckets or not self.per_decode:
            return prefill
        return fit(min(used + prefill, self.max_num_batched_tokens), self.token_buckets) - used
