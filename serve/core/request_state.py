"""A request's state in the engine core beside its sequences, and the logprob records its outputs carry."""

from __future__ import annotations

import dataclasses

import numpy as np

from serve.core.sequence import Sequence
from serve.core.step_data import LogprobArrays
from serve.types import EngineCoreRequest, TokenLogprobs

Logprob = tuple[float, np.ndarray, np.ndarray]  # one position's: log p(token), top ids, top logprobs


@dataclasses.dataclass
class CoreRequest:
    request: EngineCoreRequest
    seqs: list[Sequence]
    pending: list[Sequence]  # siblings (n > 1) admitted once the first has prefilled the prompt

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.is_finished for s in self.seqs)


def token_logprobs(token: int, lp: Logprob, k: int) -> TokenLogprobs:
    return TokenLogprobs(int(token), float(lp[0]), lp[1][:k].tolist(), lp[2][:k].tolist())


def collect_prompt_logprobs(
    seqs: list[Sequence], starts: np.ndarray, counts: np.ndarray, prompt: LogprobArrays
) -> None:
    """Keep a step's prompt logprobs (flat rows, each sequence's `counts` tokens from `starts`) that its
    sequences asked for."""
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for seq, start, n, offset in zip(seqs, starts.tolist(), counts.tolist(), offsets.tolist()):
        if seq.wants_prompt_logprobs:
            _collect(seq, prompt, start, n, offset)


def _collect(seq: Sequence, prompt: LogprobArrays, start: int, n: int, offset: int) -> None:
    """Keep the prompt logprobs of positions start..start+n (flat rows from `offset`) that a sequence asked for."""
    k = seq.params.prompt_logprobs or 0
    if not seq.prompt_logprobs:
        seq.prompt_logprobs = [None]
    for j in range(start, start + n):
        if j + 1 >= seq.prompt_len or len(seq.prompt_logprobs) != j + 1:
            continue  # past the prompt, or already collected before a preemption
        row = offset + j - start
        seq.prompt_logprobs.append(
            token_logprobs(seq.tokens[j + 1], (prompt[0][row], prompt[1][row], prompt[2][row]), k)
        )
