"""The HTTP layer without a model: a real AsyncEngine (tokenizing, validation, detokenizing, streams)
whose core is FakeCore, an in-process stand-in that speaks serve.engine.core_client.CoreHandle with the
real core's messages (encoded and decoded as on the pipe) and answers with made-up tokens.

For protocol checks (validation, error shapes, auth, tenants' bookkeeping, SSE framing): starting one
costs a tokenizer, not a core process and its compilations. tests/test_fake_engine_contract.py holds it
to the real core's shapes. Behaviour (tokens, caching, faults) stays on real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI

from jaxinfra.loading import load_config, load_tokenizer
from serve import EngineArgs
from serve.engine.async_engine import AsyncEngine
from serve.engine.core_client import DEFAULT_HEARTBEAT_TIMEOUT_S, EngineDeadError
from serve.http.app import build_app
from serve.types import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    SchedulerStats,
    TokenLogprobs,
    UtilityCall,
)
from tests.serve_helpers import ENGINE_DEFAULTS, PRESET
from tests.server_helpers import MODEL_NAME, serve_in_thread

VOCAB_SIZE = load_config(PRESET).vocab_size
# what FakeCore writes: ids that decode to one letter or digit each, so texts and stop strings read plainly
ALPHABET = [i for i in range(VOCAB_SIZE) if (c := load_tokenizer(PRESET).decode([i])).isalnum() and len(c) == 1]
STEP_S = 0.002  # a fake step: every running sequence gets one token


@dataclass
class _Seq:
    req: EngineCoreRequest
    index: int
    tokens: list[int] = field(default_factory=list)
    first: bool = True


class FakeCore:
    """An engine core in the frontend's event loop: requests are checked as the real core checks them,
    up to max_num_seqs sequences run and each gets one token per STEP_S (never an EOS token), stop token
    ids, min_tokens, max_tokens, logprobs and prompt logprobs are honoured; utility calls answer stats,
    invariant checks and prefix-cache resets."""

    def __init__(
        self,
        args: EngineArgs,
        eos_token_ids: tuple[int, ...],
        warmup: bool = True,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    ) -> None:
        max_model_len = args.max_model_len or 256
        num_blocks = args.num_gpu_blocks_override or 64
        self.args = args
        self.info = EngineCoreReady(num_blocks, max_model_len, VOCAB_SIZE, list(eos_token_ids))
        self.last_beat: float | None = None
        self._calls = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None  # the frontend's, once it first calls in
        self._outputs: asyncio.Queue[bytes] | None = None
        self._gone: asyncio.Event | None = None
        self._stepper: asyncio.Task | None = None
        self._running: list[_Seq] = []
        self._waiting: list[_Seq] = []
        self._alive = True
        self._closed = False
        self.received: list[object] = []  # every message, in order (tests read what reached the core)

    # --- CoreHandle -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def closed(self) -> bool:
        return self._closed

    def trouble(self) -> str | None:
        return None if self._alive else "the engine core process exited (code -9)"

    async def watch(self) -> str:
        await self._loop_state()[1].wait()
        return self.trouble() or "the engine core was closed"

    async def send(self, msg: EngineCoreRequest | AbortRequests | UtilityCall) -> None:
        if not self._alive or self._closed:
            raise EngineDeadError("the engine core process is not running")
        msg = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))  # what crosses the pipe
        self.received.append(msg)
        reply = EngineCoreOutputs()
        if isinstance(msg, EngineCoreRequest):
            why = self._refusal(msg)
            if why is None:
                self._waiting += [_Seq(msg, i) for i in range(msg.params.n)]
            else:
                reply.rejected.append((msg.request_id, why))
        elif isinstance(msg, AbortRequests):
            gone = set(msg.request_ids)
            seqs = set(msg.sequences)
            keep = lambda s: s.req.request_id not in gone and (s.req.request_id, s.index) not in seqs
            self._running = [s for s in self._running if keep(s)]
            self._waiting = [s for s in self._waiting if keep(s)]
        else:
            reply.utility = self._utility(msg)
        if reply.rejected or reply.utility is not None:
            reply.stats = self._stats()
            self._put(reply)
        self._ensure_stepping()

    async def recv(self) -> EngineCoreOutputs:
        outputs, _ = self._loop_state()
        self._ensure_stepping()
        return msgspec.msgpack.decode(await outputs.get(), type=EngineCoreOutputs)

    def new_call(self, method: str, args: list[Any]) -> UtilityCall:
        return UtilityCall(next(self._calls), method, args)

    def kill(self) -> None:
        """What SIGKILL does to a real core: it is gone, and the frontend's watcher hears it."""
        self._alive = False
        self._stop()

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        self._alive = False
        self._stop()

    # --- the fake core's own workings -------------------------------------------------------------
    def _loop_state(self) -> tuple[asyncio.Queue[bytes], asyncio.Event]:
        if self._outputs is None or self._gone is None:
            self._loop = asyncio.get_running_loop()
            self._outputs, self._gone = asyncio.Queue(), asyncio.Event()
            if not self._alive:
                self._gone.set()
        return self._outputs, self._gone

    def _put(self, msg: EngineCoreOutputs) -> None:
        self._loop_state()[0].put_nowait(msgspec.msgpack.encode(msg))

    def _stop(self) -> None:
        """Wake the watcher and stop stepping, from the frontend's loop or from any other thread."""

        def stop() -> None:
            if self._gone is not None:
                self._gone.set()
            if self._stepper is not None:
                self._stepper.cancel()

        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if self._loop is not None and here is not self._loop and self._loop.is_running():
            self._loop.call_soon_threadsafe(stop)
        else:
            stop()

    def _ensure_stepping(self) -> None:
        if self._stepper is None and self._alive:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever())

    def _refusal(self, req: EngineCoreRequest) -> str | None:
        """What the real core's add_request refuses (serve.core.engine_core), in its words."""
        ids, p = req.prompt_token_ids, req.params
        if not ids:
            return "prompt is empty"
        if not all(0 <= t < VOCAB_SIZE for t in ids):
            return f"prompt token ids must be ints in [0, {VOCAB_SIZE})"
        if len(ids) >= self.info.max_model_len:
            return (
                f"prompt has {len(ids)} tokens, leaving no room to generate within max_model_len "
                f"({self.info.max_model_len})"
            )
        if any(t >= VOCAB_SIZE for t in [*p.stop_token_ids, *(p.logit_bias or {})]):
            return f"SamplingParams.stop_token_ids and logit_bias keys must be in [0, {VOCAB_SIZE})"
        if any(s.req.request_id == req.request_id for s in (*self._running, *self._waiting)):
            return f"request_id {req.request_id!r} is already in use"
        return None

    def _utility(self, call: UtilityCall) -> tuple[int, str | None, object]:
        answers: dict[str, Any] = {
            "stats": self._stats,
            "check_invariants": lambda: None,
            "reset_prefix_cache": lambda: True,
            "list_loras": lambda: [],
        }
        if call.method not in answers:
            return call.call_id, f"ValueError: unknown utility call {call.method!r}", None
        return call.call_id, None, answers[call.method](*call.args)

    def _used_blocks(self) -> int:
        size = self.args.block_size
        return sum(-(-(len(s.req.prompt_token_ids) + len(s.tokens)) // size) for s in self._running)

    def _stats(self) -> SchedulerStats:
        used = self._used_blocks()
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=used / self.info.num_blocks,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            num_free_blocks=self.info.num_blocks - used,
            num_blocks=self.info.num_blocks,
            num_compilations=0,
        )

    def _token(self, seq: _Seq) -> int:
        """A made-up next token (a letter or digit, never EOS): a function of the prompt, the sequence and
        the position."""
        prompt = seq.req.prompt_token_ids
        return ALPHABET[(prompt[-1] * 31 + 17 * len(seq.tokens) + 7 * seq.index + len(prompt)) % len(ALPHABET)]

    @staticmethod
    def _logprobs(token: int, top: int) -> TokenLogprobs:
        ids = [token, *((token + k) % VOCAB_SIZE for k in range(1, top))][:top]
        return TokenLogprobs(token, -0.5, ids, [-0.5 - k for k in range(len(ids))])

    def _output(self, seq: _Seq) -> EngineCoreOutput:
        p = seq.req.params
        token = self._token(seq)
        seq.tokens.append(token)
        out = EngineCoreOutput(seq.req.request_id, seq.index, [token])
        if p.logprobs is not None:
            out.new_logprobs = [self._logprobs(token, p.logprobs)]
        if seq.first:
            seq.first = False
            out.first_scheduled = seq.req.arrival_time
            if seq.index == 0 and p.prompt_logprobs is not None:
                ids = seq.req.prompt_token_ids
                out.prompt_logprobs = [None, *(self._logprobs(t, p.prompt_logprobs) for t in ids[1:])]
        total = len(seq.req.prompt_token_ids) + len(seq.tokens)
        if len(seq.tokens) >= p.min_tokens and token in p.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", token
        elif len(seq.tokens) >= (p.max_tokens if p.max_tokens is not None else self.info.max_model_len) or (
            total >= self.info.max_model_len
        ):
            out.finish_reason = "length"
        return out

    async def _step_forever(self) -> None:
        while True:
            await asyncio.sleep(STEP_S)
            while self._waiting and len(self._running) < self.args.max_num_seqs:
                self._running.append(self._waiting.pop(0))
            if not self._running:
                continue
            outputs = [self._output(s) for s in self._running]
            self._running = [s for s, o in zip(self._running, outputs) if o.finish_reason is None]
            self._put(EngineCoreOutputs(outputs=outputs, stats=self._stats()))


def fake_engine(**engine_kwargs: Any) -> AsyncEngine:
    """An AsyncEngine over FakeCore with the tests' engine arguments (tiny-qwen3's tokenizer)."""
    args = EngineArgs(**{**ENGINE_DEFAULTS, "model": PRESET, **engine_kwargs})
    return AsyncEngine(args, warmup=False, core_factory=FakeCore)


def fake_app(
    *, api_key: str | None = None, api_keys: dict | None = None, max_queue: int = 64, **kwargs: Any
) -> FastAPI:
    """The server's app over a fake engine; kwargs are build_app's (request_timeout, …) or EngineArgs'."""
    app_options = {
        k: kwargs.pop(k) for k in ("request_timeout", "max_request_body_bytes", "protect_metrics") if k in kwargs
    }
    return build_app(
        fake_engine(**kwargs),
        model_name=MODEL_NAME,
        api_key=api_key,
        api_keys=api_keys,
        max_queue=max_queue,
        **app_options,
    )


@contextlib.contextmanager
def fake_server(**kwargs: Any) -> Iterator[tuple[str, FastAPI]]:
    """(url, app) of the fake-engine app served by uvicorn on a thread: for checks of the connection
    itself (keep-alive after an error, bodies as they arrive)."""
    app = fake_app(**kwargs)
    with serve_in_thread(app) as url:
        yield url, app


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the app itself (httpx.ASGITransport), its lifespan run around it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            yield client
