"""Structured-output requests between their arrival in the core process and the batch, as vLLM's
WAITING_FOR_FSM: each one's grammar compiles on a worker thread while the core steps the others, and
it joins the engine core when its matchers are ready, or is refused (a grammar that fails or runs
past its budget). A matcher that fails later, mid-output, fails its request the same way."""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future

from serve.core.engine_core import EngineCore
from serve.core.structured_output import Matcher, failure
from serve.types import EngineCoreOutput, EngineCoreRequest

COMPILE_BUDGET_S = 10.0  # from arrival to matchers ready; past it the request is refused

Refusal = tuple[str, str]  # (request id, why): what the frontend turns into a 400 for that request


class GrammarQueue:
    def __init__(self, core: EngineCore, budget_s: float = COMPILE_BUDGET_S) -> None:
        self.core = core
        self.budget_s = budget_s
        self.waiting: dict[str, tuple[EngineCoreRequest, Future[list[Matcher]], float]] = {}
        self.running: dict[str, list[Matcher]] = {}  # admitted requests' matchers, watched for errors

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, req: EngineCoreRequest) -> None:
        """Start compiling a structured request's grammar (ValueError if it cannot be queued)."""
        so = req.params.structured_outputs
        assert so is not None
        if req.request_id in self.waiting or req.request_id in self.core.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        future = self.core.grammar().compile(so, req.params.n)
        self.waiting[req.request_id] = (req, future, time.monotonic() + self.budget_s)

    def abort(self, request_ids: list[str]) -> None:
        """Drop waiting requests (a compile under way finishes on its thread, unused)."""
        for rid in request_ids:
            self.waiting.pop(rid, None)

    def wait(self, timeout: float) -> None:
        """Block until a grammar is ready or `timeout` s pass (the core loop, when nothing else runs)."""
        futures = [future for _, future, _ in self.waiting.values()]
        concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def admit(self) -> list[Refusal]:
        """Move requests whose matchers are ready into the core; the refused ones, with the reason."""
        refused: list[Refusal] = []
        now = time.monotonic()
        for rid, (req, future, deadline) in list(self.waiting.items()):
            if not future.done() and now < deadline:
                continue
            del self.waiting[rid]
            try:
                if not future.done():
                    raise ValueError(f"structured_outputs: the grammar did not compile within {self.budget_s:g} s")
                matchers = future.result()
                self.core.add_request(req, matchers)
            except Exception as e:  # a ValueError for a bad grammar; anything else fails this request alone
                refused.append((rid, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"))
                continue
            self.running[rid] = matchers
        return refused

    def failed(self, outputs: list[EngineCoreOutput]) -> list[Refusal]:
        """Requests whose matcher failed this step (a grammar past its per-token budget): aborted in
        the core, refused with llguidance's reason."""
        refused: list[Refusal] = []
        for out in outputs:
            matchers = self.running.get(out.request_id)
            if matchers is None or out.finish_reason != "abort" or not matchers[out.index].is_error():
                continue
            self.core.abort_requests([out.request_id])
            del self.running[out.request_id]
            refused.append((out.request_id, failure(matchers[out.index])))
        for rid in [r for r in self.running if r not in self.core.requests]:
            del self.running[rid]  # finished
        return refused
