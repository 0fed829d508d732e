"""Killing the prefill engine under load (issue #29): a real `python -m serve --role prefill` process is
SIGKILLed while requests (streamed and not) are in flight through the proxy. Every request ends, with a
complete answer or an OpenAI error, within a bound; the proxy answers 503 at once while the engine is
down; the killed engine's orphaned core exits; restarted on its port, the engine serves again and the
proxy's answers are the greedy tokens they were before the kill; the decode engine's KV pool is full
again, nothing is left outstanding anywhere and no shared memory segment is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, NamedTuple, cast

import httpx
import pytest
from fastapi import FastAPI

from serve.http.cli_args import flag
from serve.scale.disagg_proxy import Proxy, build_proxy_app
from tests.serve_helpers import ENGINE_DEFAULTS
from tests.server_helpers import MODEL_NAME, core_stats, eventually, metric, running_server, serve_in_thread

pytestmark = pytest.mark.slow  # a prefill process started twice and a decode engine: 50-65 s on 2 shared CPU cores

LONG = "the quick brown fox jumps over the lazy dog " * 3  # ~140 tokens: 3 chunked prefill steps each
WARM = [f"Psalm {i}: {LONG}" for i in range(2)]  # answered before the kill: reference answers
LOAD = [f"Verse {i}: {LONG}" for i in range(12)]  # in flight at the kill (no prefix block shared with WARM)
MAX_TOKENS = 16
END_BOUND_S = 60.0  # every request has ended within this (a client read timeout past it fails the test)
OFFER_TIMEOUT_S = 3.0  # the restarted prefill's offers that nobody pulls (decode's prefix cache hit) expire


class Answer(NamedTuple):
    """How a request through the proxy ended: an OpenAI error's message, or every greedy token."""

    error: str | None
    text: str = ""
    token_ids: tuple[int, ...] = ()


def _free_port() -> int:
    """A loopback port nobody listens on (the prefill engine's, both times it starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segments() -> set[str]:
    """The KV transfer's shared memory segments on this host."""
    return {p.name for p in Path("/dev/shm").glob("jaxinfra-kv-*")}


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (the killed server's engine core, its resource tracker)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _healthy(url: str) -> bool:
    """Whether the server at `url` is up (a refused connection is not an error while it starts)."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def prefill_process(port: int, cache: str, log: Path) -> Iterator[subprocess.Popen]:
    """`python -m serve --role prefill` starting on `port` (see _wait_up), in a session of its own (it and
    its engine core are one process group); stopped on the way out, with whatever is left of its group."""
    engine = {**ENGINE_DEFAULTS, "compilation_cache_dir": cache}
    command = [sys.executable, "-m", "serve", "--role", "prefill", "--served-model-name", MODEL_NAME]
    command += [a for k, v in engine.items() for a in (flag(k), str(v))]
    command += ["--kv-transfer-config", json.dumps({"offer_timeout_s": OFFER_TIMEOUT_S})]
    command += ["--no-warmup", "--port", str(port)]
    with log.open("a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()  # a drain, then its engine core's shutdown (nothing once it was killed)
        proc.wait(timeout=60)
        if not eventually(lambda: not _group_alive(proc.pid), timeout=30):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # an orphaned engine core


def _wait_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until the server answers /health (its log's tail if it exits first)."""
    up = eventually(lambda: proc.poll() is not None or _healthy(url), timeout=240)
    assert up and proc.poll() is None, log.read_text()[-3000:]


def _ask(url: str, prompt: str, stream: bool) -> Answer:
    """One greedy completion through `url`; a hang (httpx.ReadTimeout) or a stream cut short without an
    error event raises."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=END_BOUND_S) as r:
        if r.status_code != 200:
            r.read()
            return Answer(r.json()["error"]["message"])
        if not stream:
            r.read()
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == MAX_TOKENS, r.text
            return Answer(None, choice["text"], tuple(choice["token_ids"]))
        text, finish, done = "", None, False
        tokens: list[int] = []
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return Answer(event["error"]["message"])
                choice = event["choices"][0]
                text, tokens = text + choice["text"], tokens + (choice["token_ids"] or [])
                finish = choice["finish_reason"] or finish
        assert done and finish == "length" and len(tokens) == MAX_TOKENS, f"a stream cut short: {text!r}"
        return Answer(None, text, tuple(tokens))


def _ended(futures: list[Future], state: Callable[[], dict[str, Any]]) -> list[Answer]:
    """The requests' answers, every one ended within END_BOUND_S (the message shows `state()` if not)."""
    _, hung = wait(futures, timeout=END_BOUND_S)
    assert not hung, f"{len(hung)} requests still open after {END_BOUND_S} s: {state()}"
    return [f.result() for f in futures]


def test_prefill_killed_under_load(tmp_path):
    cache, port = str(tmp_path / "xla-cache"), _free_port()
    p_url, log = f"http://127.0.0.1:{port}", tmp_path / "prefill.log"
    segments_before = _segments()
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(prefill_process(port, cache, log))  # starts while the decode engine does
        d_url, d_app = stack.enter_context(
            running_server(compilation_cache_dir=cache, kv_transfer_config={"kv_role": "kv_consumer"})
        )
        _wait_up(prefill, p_url, log)
        proxy = Proxy([p_url], [d_url], prefill_timeout=120)  # the first requests compile the steps
        app = build_proxy_app(proxy)
        app.state.server = types.SimpleNamespace(engine=types.SimpleNamespace(shutdown=lambda: None))
        url = stack.enter_context(serve_in_thread(app))

        def state() -> dict[str, Any]:
            """What is outstanding: the proxy's upstream calls, the decode engine's sequences and blocks."""
            s = core_stats(d_app)
            decode = dict(running=s.num_running, waiting=s.num_waiting, free=s.num_free_blocks, blocks=s.num_blocks)
            in_flight = cast(FastAPI, d_app).state.server.in_flight
            return dict(proxy=proxy.status(), decode=decode, decode_in_flight=in_flight)

        want = {p: _ask(url, p, stream) for p, stream in zip(WARM, (False, True))}
        assert not any(a.error for a in want.values()), want

        with ThreadPoolExecutor(len(LOAD)) as pool:
            futures = [pool.submit(_ask, url, p, i % 2 == 1) for i, p in enumerate(LOAD)]

            def mid_load() -> bool:
                """Some requests prefilling, others decoding."""
                return proxy.prefill.outstanding[p_url] > 0 and proxy.decode.outstanding[d_url] > 0

            assert eventually(mid_load, timeout=60), "never a request on each side at once"
            prefill.send_signal(signal.SIGKILL)
            answers = dict(zip(LOAD, _ended(futures, state)))
        errors = {p: a.error for p, a in answers.items() if a.error is not None}
        assert 0 < len(errors) < len(LOAD), answers  # the kill cut some prefills short, and no decode
        assert all(f"The prefill engine {p_url} " in e for e in errors.values()), errors
        want |= {p: a for p, a in answers.items() if a.error is None}

        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": WARM[0], "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_unavailable", r.text
        assert time.monotonic() - start < 5
        prefill.wait(timeout=10)
        assert eventually(lambda: not _group_alive(prefill.pid), timeout=60), "the killed engine's core lives on"

        _wait_up(stack.enter_context(prefill_process(port, cache, log)), p_url, log)
        again = [*want, *list(errors)[:2]]
        with ThreadPoolExecutor(len(again)) as pool:
            futures = [pool.submit(_ask, url, p, i % 2 == 1) for i, p in enumerate(again)]
            answers = dict(zip(again, _ended(futures, state)))
        assert not any(a.error for a in answers.values()), answers
        assert {p: answers[p] for p in want} == want

        def settled() -> bool:
            """The decode pool full and idle, nothing in flight at the proxy, the prefill's offers gone."""
            s = state()
            return (
                s["decode"]["free"] == s["decode"]["blocks"]
                and s["decode"]["running"] == s["decode"]["waiting"] == s["decode_in_flight"] == 0
                and not any({**proxy.prefill.outstanding, **proxy.decode.outstanding}.values())
                and metric(p_url, "jaxinfra:kv_transfer_offered_blocks") == 0
            )

        assert eventually(settled, timeout=OFFER_TIMEOUT_S + 30), state()
        assert metric(p_url, "jaxinfra:kv_transfer_blocks_total", event="offered") > 0  # exported: 0 above is real
    assert _segments() <= segments_before  # every segment pulled, expired or unlinked by its exiting core
