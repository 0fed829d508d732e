"""Prompt-lookup (n-gram) proposals on the host, vectorised over the batch with numpy.

As vLLM's NgramProposer: for each row, the longest suffix n-gram (prompt_lookup_min <= n <=
prompt_lookup_max) of its prompt + output that occurred before, earliest occurrence first; the k
tokens that followed it are the draft (fewer where the history ends first).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Int

from serve.core.sequence import Sequence
from serve.core.spec_decode.config import SpeculativeConfig
from serve.core.step_data import SchedulerOutput, StepResult


class NgramProposer:
    """Drafts of num_speculative_tokens for a batch of token histories."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise ValueError(f"NgramProposer needs speculative_config.method 'ngram', got {config.method!r}")
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.lookahead = 0  # KV slots a step needs past its own tokens

    def propose(
        self,
        tokens: Int[np.ndarray, "B L"],
        num_tokens: Int[np.ndarray, " B"],
        max_new: Int[np.ndarray, " B"] | None = None,
    ) -> Int[np.ndarray, "B K"]:
        """Drafts [B, k] (-1 pads) for histories left-aligned in `tokens` (row b's first num_tokens[b]),
        at most max_new[b] per row (room left before max_model_len / max_tokens)."""
        b, width = tokens.shape
        num_tokens = np.asarray(num_tokens, np.int64)
        # length[b, e]: how many tokens ending at e equal the history's suffix (at most max_n), for
        # ends e that a continuation follows within the history; one pass per suffix position
        run = np.arange(width)[None, :] < num_tokens[:, None] - 1
        length = np.zeros((b, width), np.int32)
        for j in range(min(self.max_n, width - 1)):
            last = tokens[np.arange(b), np.maximum(num_tokens - 1 - j, 0)]
            run[:, :j] = False  # the n-gram would start before the history
            run[:, j:] &= tokens[:, : width - j] == last[:, None]
            length += run
        best = length.max(axis=1, initial=0)  # the longest suffix n-gram that occurred before
        found = best >= self.min_n
        start = (length >= np.maximum(best, 1)[:, None]).argmax(axis=1) + 1  # its earliest occurrence's end + 1
        limit = num_tokens if max_new is None else np.minimum(num_tokens, start + np.asarray(max_new))
        at = start[:, None] + np.arange(self.k)
        valid = found[:, None] & (at < limit[:, None])
        drafts = np.take_along_axis(tokens, np.minimum(at, width - 1), axis=1)
        return np.where(valid, drafts, -1).astype(np.int32)

    def propose_seqs(self, seqs: list[Sequence], max_new: list[int]) -> list[list[int]]:
        """`propose` for the scheduler's sequences: each row's draft, at most max_new[b] tokens."""
        histories = [s.tokens for s in seqs]
        lengths = np.fromiter(map(len, histories), np.int64, len(histories))
        tokens = np.full((len(histories), int(lengths.max(initial=1))), -1, np.int32)
        for row, history in enumerate(histories):
            tokens[row, : len(history)] = history
        drafts = self.propose(tokens, lengths, np.asarray(max_new))
        return [row[row >= 0].tolist() for row in drafts]

    def before_step(self, sched: SchedulerOutput) -> None:
        """Nothing: drafts come from the token history alone."""

    def after_step(self, sched: SchedulerOutput, res: StepResult) -> None:
        """Nothing: the next drafts are made from the tokens the step appends."""
