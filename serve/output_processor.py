"""Output processor: turns the core's new token ids into text and RequestOutputs.

Per sequence it keeps an incremental detokenizer; a stop string that matches finishes the sequence
here, and the processor reports the request so the caller can abort it in the core. Outputs come in
vLLM's three kinds: cumulative, delta (only what is new; streams) and final_only.
"""

from __future__ import annotations

import dataclasses
import time

from jaxinfra.tokenizer import Tokenizer
from serve.core_types import EngineCoreOutput, TokenLogprobs
from serve.detokenizer import IncrementalDetokenizer
from serve.outputs import CompletionOutput, Logprobs, RequestMetrics, RequestOutput
from serve.sampling_params import SamplingParams


def logprob_entry(lp: TokenLogprobs) -> dict[int, float]:
    """{token id: logprob}: the top alternatives in descending order, then the chosen token."""
    entry = dict(zip(lp.top_ids, lp.top_logprobs))
    entry.setdefault(lp.token, lp.logprob)
    return entry


@dataclasses.dataclass
class _Seq:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: Logprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0     # delta mode: characters and tokens already delivered, and the finish
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestIteration:
    """What one batch of core outputs meant for one request (for metrics)."""

    request_id: str
    new_tokens: int
    metrics: RequestMetrics
    first_tokens: bool           # this batch brought the request's first output tokens
    finish_reason: str | None    # the request finished (first sequence's reason, or "abort")


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclasses.dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    iterations: list[RequestIteration]
    to_abort: list[tuple[str, int]]  # (request, sequence) finished here by a stop string: the core drops them


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float) -> None:
        seqs = [_Seq(i, IncrementalDetokenizer(self.tokenizer, params), logprobs=[] if params.logprobs is not None
                     else None) for i in range(params.n)]
        self.requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), params, seqs,
                                             RequestMetrics(arrival_time=arrival_time))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        touched: dict[str, int] = {}
        first: set[str] = set()
        to_abort: list[tuple[str, int]] = []
        for co in core_outputs:
            req = self.requests.get(co.request_id)
            if req is None or req.seqs[co.index].finished:
                continue  # aborted here, or already finished by a stop string
            seq = req.seqs[co.index]
            if co.first_scheduled is not None:
                req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or co.first_scheduled
                req.num_cached_tokens = max(req.num_cached_tokens, co.num_cached_tokens)
            if co.prompt_logprobs is not None:
                req.prompt_logprobs = [None if lp is None else logprob_entry(lp) for lp in co.prompt_logprobs]
            tokens, logprobs = co.new_token_ids, co.new_logprobs
            stop_at = seq.detok.add(tokens)
            if stop_at is not None:
                tokens, logprobs = tokens[:stop_at + 1], logprobs and logprobs[:stop_at + 1]
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stop_reason
            elif co.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
            seq.token_ids.extend(tokens)
            if seq.logprobs is not None and logprobs:
                seq.logprobs.extend(logprob_entry(lp) for lp in logprobs)
                seq.cumulative_logprob += sum(lp.logprob for lp in logprobs)
            if tokens and req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                first.add(req.request_id)
            if tokens:
                req.metrics.last_token_time = now
            touched[req.request_id] = touched.get(req.request_id, 0) + len(tokens)
            if stop_at is not None and co.finish_reason is None:
                to_abort.append((req.request_id, seq.index))
        outputs, iterations = [], []
        for rid, new in touched.items():
            req = self.requests[rid]
            finished = req.finished
            if finished:
                req.metrics.finished_time = now
                del self.requests[rid]
            iterations.append(RequestIteration(rid, new, req.metrics, rid in first,
                                               req.seqs[0].finish_reason if finished else None))
            out = self._output(req, finished)
            if out is not None:
                outputs.append(out)
        return ProcessedOutputs(outputs, iterations, to_abort)

    def abort(self, request_id: str) -> tuple[RequestOutput, RequestIteration] | None:
        """Finish a request as aborted (the caller aborts it in the core); None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
        req.metrics.finished_time = time.monotonic()
        return self._output(req, True, force=True), RequestIteration(request_id, 0, req.metrics, False, "abort")

    def _output(self, req: _Request, finished: bool, force: bool = False) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind == "final_only" and not finished:
            return None
        outs = []
        for seq in req.seqs:
            end = seq.detok.streamable(seq.finished)
            if kind == "delta":
                text, ids = seq.detok.text[seq.sent_text:end], seq.token_ids[seq.sent_tokens:]
                logprobs = None if seq.logprobs is None else seq.logprobs[seq.sent_tokens:]
                if not (text or ids or (seq.finished and not seq.sent_finish) or force):
                    continue
                seq.sent_text, seq.sent_tokens = max(end, seq.sent_text), len(seq.token_ids)
                seq.sent_finish = seq.finished
            else:
                text, ids, logprobs = seq.detok.text[:end], list(seq.token_ids), seq.logprobs and list(seq.logprobs)
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=logprobs if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        if not outs:
            return None
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             prompt_logprobs=req.prompt_logprobs, outputs=outs, finished=finished,
                             metrics=req.metrics, num_cached_tokens=req.num_cached_tokens)
