"""How many prompt tokens a step may take beside running decodes (EngineArgs.prefill_tokens_per_decode)."""

from __future__ import annotations

import dataclasses

from serve.core.runner.sizing import fit

MIN_COUNTED = 16  # running sequences counted at least: small batches still admit a prompt chunk a step


@dataclasses.dataclass
class PrefillBudget:
    """While sequences run, a step's prompt tokens are capped at `per_decode` per running sequence, then
    stretched to fill the token bucket the step is padded to anyway (padding costs what tokens cost);
    `per_decode` 0 (or nothing running) leaves the whole step budget to prompts, as vLLM does."""

    max_num_batched_tokens: int
    per_decode: int = 0
    token_buckets: tuple[int, ...] = ()  # the steps' (CoreLayout's)

    def cap(self, running: int) -> int:
        """Prompt tokens a step may take with `running` sequences running."""
        if not self.per_decode or not running:
            return self.max_num_batched_tokens
        return self.per_decode * max(running, MIN_COUNTED)

    def fill(self, used: int, prefill: int) -> int:
        """Prompt tokens waiting prompts may add to a step that holds `used` tokens and has `prefill` of
        its cap left: the rest of the cap, up to the end of the token bucket the step pads to."""
        if not self.token_buckets or not self.per_decode:
            return prefill
        return fit(min(used + prefill, self.max_num_batched_tokens), self.token_buckets) - used
