"""A decode loop's tokens reach streams as the loop makes them, each its own output.

The loop hands each iteration's tokens and stop codes to the host through a device tap writing to a
pipe (serve.core.pipe_tap); a sender thread, the only one that sends the core's messages, reads it and
turns them into one-token outputs, a row's last with its finish reason (the same rule as the host's,
so a stream ends with its last token, not when the loop does). Order is kept by holding a step's
tokens until every earlier step's results went out (so a token never overtakes the one before it,
and rows that finished earlier are dropped), and by removing from a step's results the tokens already
streamed. Everything goes through the one pipe (the core's own events as markers for a queue beside
it), so the sender sees the events in the order they happened: a step registered before it is
dispatched, its taps before its results. A loop's tokens need not wait for an earlier loop's results
when that loop streamed every row (`_ready`): at a loop boundary the next loop's first token goes out
without waiting for the host to read the last.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from serve.core.pipe_tap import TapPipe
from serve.core.sequence import Sequence, finish_reason
from serve.types import EngineCoreOutput, EngineCoreOutputs

# A streamed row: (request id, sequence index, the loop token that ends it by max_tokens or max_model_len,
# 0 if none), None for one that is not streamed
Row = tuple[str, int, int] | None
_STOP = object()


@dataclasses.dataclass
class _Step:
    rows: list[Row] | None  # a decode loop's streamed rows; None for a step that streams nothing
    seen: set[int] = dataclasses.field(default_factory=set)  # loop iterations received: each is streamed once
    held: list[np.ndarray] = dataclasses.field(default_factory=list)  # iterations waiting for earlier results
    sent: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)  # tokens streamed per row
    ended: set[tuple[str, int]] = dataclasses.field(default_factory=set)  # rows whose finish was streamed


class LoopTokenStream:
    """The core process's sender: every message leaves through `send`, called from one thread."""

    def __init__(self, send: Callable[[EngineCoreOutputs], None]) -> None:
        self._send = send
        self._pipe = TapPipe()
        self._events: collections.deque[Any] = collections.deque()  # one pipe marker each
        self._steps: dict[int, _Step] = {}  # dispatched, results not yet sent (ids ascending)
        self._done = -1  # the last step id whose results were sent
        self._finished: set[tuple[str, int]] = set()  # rows the last results finished
        self._thread = threading.Thread(target=self._run, name="core-output", daemon=True)
        self._thread.start()

    # --- called by the core's threads -------------------------------------------------------------
    def register(self, step_id: int, rows: list[Row] | None) -> None:
        """A step about to be dispatched (every step, in order): a loop with its streamed rows, or None."""
        self._post(("register", step_id, rows))

    def device_tap(self, mesh: Mesh | None = None) -> Callable[[jax.Array], jax.Array]:
        """The traced tap a decode loop calls each iteration with [step id, loop iteration, S tokens
        (-1: none), S stop codes] (serve.core.pipe_tap.TapPipe.device_tap)."""
        return self._pipe.device_tap(mesh)

    def tap(self, values: np.ndarray) -> None:
        """What the device tap writes, from the host: one iteration's values as above."""
        self._pipe.write(values)

    def results(self, msg: EngineCoreOutputs, applied: int) -> None:
        """A step's message carrying the results of every step up to `applied` (-1: none yet)."""
        self._post(("results", msg, applied))

    def send(self, msg: EngineCoreOutputs) -> None:
        """Any other message (stats while idle, a utility call's answer)."""
        self._post(("send", msg))

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the sender."""
        self._post(_STOP)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._pipe.close()

    def _post(self, event: Any) -> None:
        self._events.append(event)  # before its marker: the reader pops it when it reads the marker
        self._pipe.mark()

    # --- the sender thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                values = self._pipe.read()
                if values is not None:
                    self._on_tap(values)
                    continue
                event = self._events.popleft()
                if event is _STOP:
                    return
                kind, *args = event
                getattr(self, f"_on_{kind}")(*args)
        except BaseException:  # the frontend must see a dead core, not a silent one
            traceback.print_exc(file=sys.stderr)
            os._exit(1)

    def _on_register(self, step_id: int, rows: list[Row] | None) -> None:
        self._steps[step_id] = _Step(rows)

    def _on_send(self, msg: EngineCoreOutputs) -> None:
        self._send(msg)

    def _on_tap(self, values: np.ndarray) -> None:
        step_id, i = int(values[0]), int(values[1])
        step = self._steps.get(step_id)
        if step is None or step.rows is None or i in step.seen:
            return
        step.seen.add(i)
        if self._ready(step_id):
            self._stream(step, values[2:], self._ended_before(step_id))
        else:
            step.held.append(values[2:])

    def _ready(self, step_id: int) -> bool:
        """A step's tokens may stream once every earlier step's results went out, or while the earlier
        steps still out are loops that streamed every row: one device runs steps in order, so their
        tokens all went out before this step's, and their results bring nothing a stream must see
        first (a loop's first step over a row whose prompt just finished does not stream that row:
        its results carry the first token, so they are waited for)."""
        for earlier in range(self._done + 1, step_id):
            step = self._steps.get(earlier)
            if step is None or step.rows is None or None in step.rows:
                return False
        return True

    def _ended_before(self, step_id: int) -> set[tuple[str, int]]:
        """Rows whose finish a step still out before `step_id` streamed (their later tokens are not theirs)."""
        ended: set[tuple[str, int]] = set()
        for earlier in range(self._done + 1, step_id):
            ended |= self._steps[earlier].ended
        return ended

    def _stream(self, step: _Step, values: np.ndarray, ended: set[tuple[str, int]]) -> None:
        """One iteration's tokens, a one-token output per row; a row's last says how it finished (the
        host's rule, `finish_reason`, of its stop code or its length token). Rows that
        finished earlier (`_finished` by the last results, `ended` by a loop still out) are skipped."""
        assert step.rows is not None
        s = len(values) // 2
        outputs = []
        for row, token, how in zip(step.rows, values[:s].tolist(), values[s:].tolist()):
            if token < 0 or row is None or row[:2] in self._finished or row[:2] in ended:
                continue
            out = EngineCoreOutput(row[0], row[1], [token])
            n = step.sent[row[:2]] = step.sent.get(row[:2], 0) + 1
            out.finish_reason, out.stop_reason = finish_reason(token, how, n == row[2])
            if out.finish_reason is not None:
                step.ended.add(row[:2])
            outputs.append(out)
        if outputs:
            self._send(EngineCoreOutputs(outputs=outputs))

    def _on_results(self, msg: EngineCoreOutputs, applied: int) -> None:
        if applied > self._done:
            streamed: dict[tuple[str, int], int] = {}
            ended: set[tuple[str, int]] = set()
            for step_id in range(self._done + 1, applied + 1):
                step = self._steps.pop(step_id, _Step(None))
                ended |= step.ended
                for row, n in step.sent.items():
                    streamed[row] = streamed.get(row, 0) + n
            self._finished = {(o.request_id, o.index) for o in msg.outputs if o.finish_reason is not None}
            msg.outputs = [o for o in msg.outputs if _trim(o, streamed.get((o.request_id, o.index), 0), ended)]
            self._done = applied
        self._send(msg)
        for step_id in sorted(self._steps):  # held tokens of the steps now ready, in step order
            if not self._ready(step_id):
                break
            following = self._steps[step_id]
            for values in following.held:
                self._stream(following, values, self._ended_before(step_id))
            following.held.clear()


def _trim(out: EngineCoreOutput, streamed: int, ended: set[tuple[str, int]]) -> bool:
    """Drop the first `streamed` tokens (already sent one by one) and a finish already sent; False if
    nothing is left to say."""
    if streamed:
        del out.new_token_ids[:streamed]
        if out.new_logprobs is not None:
            del out.new_logprobs[:streamed]
    if (out.request_id, out.index) in ended:
        out.finish_reason = out.stop_reason = None
    return bool(
        out.new_token_ids
        or out.finish_reason is not None
        or out.first_scheduled is not None
        or out.kv_transfer_params is not None
    )


def streams_in_loop(seq: Sequence, num_computed: int) -> bool:
    """A decode loop streams this row's tokens as made (when its tokens are streamed at all): tokens
    without logprobs (the tap carries none), past the first (`num_computed`, before the loop, covers the
    prompt: a first token comes with the step's results, which carry what a first output says)."""
    return seq.params.logprobs is None and num_computed >= seq.prompt_len
