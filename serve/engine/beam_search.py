"""Beam search as vLLM runs it: beams grow one token at a time through the ordinary engine (each
step is a batch of one-token requests asking for top logprobs; prefix caching keeps the shared
prefix's KV), with Hugging Face `transformers`' selection, length penalty and early stopping, so the
result equals `generate(num_beams=..., do_sample=False)`.

Each step takes the `(1 + max(1, eos ids)) * beam_width` best continuations over all beams (by summed
logprob); of those, the ones that end (an EOS id, or the token limit) and rank among the first
`beam_width` become finished hypotheses scored `sum_logprob / generated_len ** length_penalty`
(generated_len counts the EOS), and the best `beam_width` others run on. `early_stopping`: True stops
once `beam_width` hypotheses are finished; False (the default) stops when the best running beam,
scored at its current length, cannot beat the worst finished one; "never" scores it at the token
limit when `length_penalty` > 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from serve.sampling_params import MAX_LOGPROBS, SamplingParams
from serve.types import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from serve.engine.async_engine import AsyncEngine

EarlyStopping = bool | Literal["never"]


@dataclasses.dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (plus HF's early_stopping); checked on construction."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be a positive int, got {value!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise ValueError(f"BeamSearchParams.length_penalty must be a number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"BeamSearchParams.early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )

    @classmethod
    def from_sampling_params(cls, p: SamplingParams) -> BeamSearchParams:
        """The beam search a `SamplingParams(use_beam_search=True)` asks for: `best_of` (or `n`) beams."""
        if p.max_tokens is None:
            raise ValueError("SamplingParams.max_tokens must be set for beam search")
        return cls(p.best_of or p.n, p.max_tokens, p.ignore_eos, p.length_penalty, p.early_stopping)


@dataclasses.dataclass
class BeamSearchSequence:
    """One hypothesis: its generated tokens, summed logprob and length-penalized score, and per token
    the step's top candidates' logprobs (the chosen token among them)."""

    tokens: list[int]
    cum_logprob: float
    score: float = 0.0
    finished: bool = False  # ended with an EOS id (else it reached max_tokens)
    text: str | None = None
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)

    def top_logprobs(self, k: int) -> list[dict[int, float]]:
        """Per token, its logprob and the `k` most likely tokens' (what `logprobs: k` asks for)."""
        out = []
        for token, top in zip(self.tokens, self.logprobs):
            best = dict(sorted(top.items(), key=lambda kv: -kv[1])[:k])
            out.append({token: top[token], **best})
        return out


@dataclasses.dataclass
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: the best hypotheses, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]

    def to_request_output(
        self, request_id: str, prompt: str | None, n: int, logprobs: int | None = None
    ) -> RequestOutput:
        """The `n` best hypotheses as a finished RequestOutput (what a `use_beam_search` request answers),
        each token with its `logprobs` top alternatives when asked."""
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None,
            outputs=[
                CompletionOutput(
                    i,
                    s.text or "",
                    s.tokens,
                    s.cum_logprob,
                    None if logprobs is None else s.top_logprobs(logprobs),
                    "stop" if s.finished else "length",
                )
                for i, s in enumerate(self.sequences[:n])
            ],
            finished=True,
        )


class BeamSearch:
    """The beams of one prompt. `pending()` lists the token sequences whose next-token logprobs the
    next step needs; `advance()` takes them; `done` says when the answer is settled."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int]) -> None:
        self.prompt = list(prompt)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.keep = (1 + max(1, len(eos_token_ids))) * params.beam_width
        if self.keep > MAX_LOGPROBS:
            raise ValueError(
                f"beam search keeps {self.keep} candidates a step (beam width {params.beam_width}), more than the "
                f"{MAX_LOGPROBS} top logprobs a step returns: use a smaller beam width"
            )
        self.running = [BeamSearchSequence([], 0.0)]
        self.finished: list[BeamSearchSequence] = []
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def pending(self) -> list[list[int]]:
        return [] if self.done else [self.prompt + b.tokens for b in self.running]

    def advance(self, logprobs: list[dict[int, float]]) -> None:
        """One step: `logprobs[i]` holds the top next-token logprobs of `pending()[i]`."""
        p = self.params
        candidates = sorted(
            (
                BeamSearchSequence([*beam.tokens, token], beam.cum_logprob + lp, logprobs=[*beam.logprobs, top])
                for beam, top in zip(self.running, logprobs)
                for token, lp in top.items()
            ),
            key=lambda c: -c.cum_logprob,
        )[: self.keep]
        length = len(self.running[0].tokens) + 1
        for c in candidates:
            c.finished = c.tokens[-1] in self.eos
        ends = [c.finished or length >= p.max_tokens for c in candidates]
        full = len(self.finished) == p.beam_width
        if self.improvable and not (full and p.early_stopping is True):
            for c, end in zip(candidates[: p.beam_width], ends):
                if end:
                    c.score = c.cum_logprob / length**p.length_penalty
                    self.finished.append(c)
            self.finished = sorted(self.finished, key=lambda c: -c.score)[: p.beam_width]
        self.running = [c for c, end in zip(candidates, ends) if not end][: p.beam_width]
        if all(ends) or not self.running:
            self.done = True
            return
        if len(self.finished) == p.beam_width:
            horizon = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else length
            best_possible = self.running[0].cum_logprob / horizon**p.length_penalty
            self.improvable = self.improvable and best_possible > self.finished[-1].score
            self.done = not self.improvable or p.early_stopping is True

    def output(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        seqs = self.finished
        for s in seqs:
            s.text = decode([t for t in s.tokens if t not in self.eos]) if decode else None
        return BeamSearchOutput(self.prompt, seqs)


def step_params(search: BeamSearch) -> SamplingParams:
    """The one-token request each beam sends per step: greedy, with the top logprobs beam search needs."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprobs=search.keep, ignore_eos=True)


async def beam_search_async(
    engine: AsyncEngine, request_id: str, prompt: list[int], params: BeamSearchParams, **options: Any
) -> BeamSearchOutput:
    """One prompt's beam search over the server's engine: each step's beams run as concurrent requests
    carrying the call's engine `options` (cache salt, priority, tenant and weight); cancelling it
    aborts them at once."""

    async def last(rid: str, tokens: list[int], p: SamplingParams) -> RequestOutput:
        async with contextlib.aclosing(await engine.add_request(rid, tokens, p, **options)) as stream:
            outs = [out async for out in stream]
        return outs[-1]

    search = BeamSearch(prompt, params, engine.core.info.eos_token_ids)
    step = 0
    while not search.done:
        pending = search.pending()
        outs = await asyncio.gather(
            *(last(f"{request_id}-beam{step}-{k}", seq, step_params(search)) for k, seq in enumerate(pending))
        )
        search.advance([(o.outputs[0].logprobs or [{}])[0] for o in outs])
        step += 1
    tok = engine.tokenizer
    return search.output(tok.decode if tok else None)
