"""Output processor: turns the core's new token ids into text and RequestOutputs.

Per sequence it keeps an incremental detokenizer; a stop string that matches finishes the sequence
here, and the processor reports the request so the caller can abort it in the core. Outputs come in
vLLM's three kinds: cumulative, delta (only what is new; streams) and final_only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxinfra.tokenizer import Tokenizer
from serve.engine.detokenizer import IncrementalDetokenizer
from serve.sampling_params import SamplingParams
from serve.types import CompletionOutput, EngineCoreOutput, Logprobs, RequestMetrics, RequestOutput, TokenLogprobs


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
    sent_text: int = 0  # delta mode: characters and tokens already delivered, and the finish
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
    first_tokens: bool  # this batch brought the request's first output tokens
    finish_reason: str | None  # the request finished (first sequence's reason, or "abort")


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
    unfinished: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    def finish(self, seq: _Seq, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.finish_reason is None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.unfinished -= 1


@dataclasses.dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    iterations: list[RequestIteration]
    to_abort: list[tuple[str, int]]  # (request, sequence) finished here by a stop string: the core drops them


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        seqs = [
            _Seq(
                i, IncrementalDetokenizer(self.tokenizer, params), logprobs=[] if params.logprobs is not None else None
            )
            for i in range(params.n)
        ]
        self.requests[request_id] = _Request(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            seqs,
            RequestMetrics(arrival_time=arrival_time),
            unfinished=params.n,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        touched: dict[str, int] = {}
        first: set[str] = set()
        to_abort: list[tuple[str, int]] = []
        requests = self.requests
        for co in core_outputs:
            req = requests.get(co.request_id)
            if req is None:
                continue  # aborted here
            seq = req.seqs[co.index]
            if seq.finish_reason is not None:
                continue  # already finished by a stop string
            if co.first_scheduled is not None:
                self._first_output(req, co)
            tokens, logprobs = co.new_token_ids, co.new_logprobs
            stop_at = seq.detok.add(tokens)
            if stop_at is not None:
                tokens, logprobs = tokens[: stop_at + 1], logprobs and logprobs[: stop_at + 1]
                req.finish(seq, "stop", seq.detok.stop_reason)
                if co.finish_reason is None:
                    to_abort.append((req.request_id, seq.index))
            elif co.finish_reason is not None:
                req.finish(seq, co.finish_reason, co.stop_reason)
            req.kv_transfer_params = co.kv_transfer_params or req.kv_transfer_params
            seq.token_ids += tokens
            if logprobs and seq.logprobs is not None:
                seq.logprobs.extend(logprob_entry(lp) for lp in logprobs)
                seq.cumulative_logprob += sum(lp.logprob for lp in logprobs)
            if tokens:
                m = req.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                    first.add(req.request_id)
                m.last_token_time = now
            touched[req.request_id] = touched.get(req.request_id, 0) + len(tokens)
        outputs, iterations = [], []
        for rid, new in touched.items():
            req = requests[rid]
            finished = req.unfinished == 0
            if finished:
                req.metrics.finished_time = now
                del requests[rid]
            iterations.append(
                RequestIteration(rid, new, req.metrics, rid in first, req.seqs[0].finish_reason if finished else None)
            )
            out = self._output(req, finished)
            if out is not None:
                outputs.append(out)
        return ProcessedOutputs(outputs, iterations, to_abort)

    @staticmethod
    def _first_output(req: _Request, co: EngineCoreOutput) -> None:
        req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or co.first_scheduled
        req.num_cached_tokens = max(req.num_cached_tokens, co.num_cached_tokens)
        if co.prompt_logprobs is not None:
            req.prompt_logprobs = [None if lp is None else logprob_entry(lp) for lp in co.prompt_logprobs]

    def abort(self, request_id: str) -> tuple[RequestOutput, RequestIteration] | None:
        """Finish a request as aborted (the caller aborts it in the core); None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            req.finish(seq, "abort")
        req.metrics.finished_time = time.monotonic()
        out = self._output(req, True, force=True)
        assert out is not None  # forced
        return out, RequestIteration(request_id, 0, req.metrics, False, "abort")

    def _output(self, req: _Request, finished: bool, force: bool = False) -> RequestOutput | None:
        kind = req.params.output_kind
        if kind == "final_only" and not finished:
            return None
        outs = []
        for seq in req.seqs:
            done = seq.finish_reason is not None
            detok = seq.detok
            end = detok.streamable(done)
            if kind == "delta":
                ids = seq.token_ids[seq.sent_tokens :]
                text = detok.text[seq.sent_text : end] if end > seq.sent_text else ""
                if not (text or ids or force or (done and not seq.sent_finish)):
                    continue
                logprobs = None if seq.logprobs is None else seq.logprobs[seq.sent_tokens :]
                seq.sent_text, seq.sent_tokens, seq.sent_finish = max(end, seq.sent_text), len(seq.token_ids), done
            else:
                text, ids, logprobs = detok.text[:end], list(seq.token_ids), seq.logprobs and list(seq.logprobs)
            outs.append(
                CompletionOutput(
                    seq.index,
                    text,
                    ids,
                    None if seq.logprobs is None else seq.cumulative_logprob,
                    logprobs,
                    seq.finish_reason,
                    seq.stop_reason,
                )
            )
        if not outs:
            return None
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            req.prompt_logprobs,
            outs,
            finished,
            req.metrics,
            req.num_cached_tokens,
            req.kv_transfer_params,
        )
