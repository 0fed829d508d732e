"""The engine-core process: loads the model, then busy-loops on steps, fed by its frontend.

One channel (serve.core.transport) joins them, a pipe each way: requests, aborts and utility calls
arrive as frames on one; readiness (or why it could not start), outputs, scheduler stats, utility
results and heartbeats leave as frames on the other, all msgpack-encoded msgspec structs. It runs
until terminated, until its parent dies or closes its end, or until a step raises (the frontend sees
the process end and fails what was in flight). From its first moment a thread of its own sends
heartbeats, whatever the step loop is doing (a step may compile for minutes): a frontend that hears
nothing knows the process itself is stuck.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import traceback

import jax
import msgspec

from serve.config import EngineArgs
from serve.core.engine_core import EngineCore
from serve.core.grammar_queue import GrammarQueue
from serve.core.loop_stream import LoopTokenStream
from serve.core.model_loading import enable_compilation_cache, load_engine_model
from serve.core.pids import exit_with_parent
from serve.core.transport import FrameReader, FrameWriter, Kind, decoders
from serve.types import (
    AbortRequests,
    CoreLaunch,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    StartupError,
    UtilityCall,
)

# glibc malloc settings for the core: XLA's CPU buffers are freed and allocated again every step;
# served from one arena that is never trimmed, they stop costing page faults (2-3x on CPU steps).
ALLOCATOR_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**36),
    "MALLOC_TOP_PAD_": str(2**26),
}
IDLE_WAKE_MS = 1000  # an idle core wakes this often to poll KV transfers
GRAMMAR_POLL_S = 0.01  # how long an otherwise idle core waits on compiling grammars between input checks
HEARTBEAT_INTERVAL_S = 0.2
# How long the step loop may hold the GIL while the decode loop's tap waits for it (Python's 5 ms
# default would stall the device that long, once a loop, at large batches)
SWITCH_INTERVAL_S = 0.0005


def start_heartbeat(out: FrameWriter) -> None:
    """Send a heartbeat frame every HEARTBEAT_INTERVAL_S from a daemon thread (while the frontend does
    not read, the pipe fills and the beat waits with the core's other frames: only silence matters)."""

    def beat() -> None:
        while True:
            try:
                out.write(Kind.HEARTBEAT)
            except OSError:
                return  # the frontend closed its end
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def build_core(
    args: EngineArgs, eos_token_ids: tuple[int, ...], warmup: bool, stream: LoopTokenStream | None = None
) -> EngineCore:
    """Load the model and build (and optionally warm up) an EngineCore; `stream`: its decode loops'
    tokens are streamed through it. With args.background_compile, warm-up goes on after this returns."""
    enable_compilation_cache(args.compilation_cache_dir)
    core = EngineCore(load_engine_model(args), args, eos_token_ids, stream=stream)
    if warmup and args.runner != "pooling":  # a pooling engine runs no generation step
        core.runner.warmup(args.background_compile, args.compile_threads)
    return core


def start_xla_off_reserved_cores(reserved: int) -> None:
    """Start XLA's CPU client with this thread bound to all but the last `reserved` cores, so the
    threads XLA starts now (its pool and the thread that runs each step) stay off them, as vLLM's CPU
    server binds its OpenMP threads; this thread, and the Python threads started later, may then run
    anywhere again (XLA runs a step on two threads even with a pool of one: unbound, the second one
    also ran on the reserved core)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if not reserved or len(allowed) <= reserved:
        jax.devices()
        return
    os.sched_setaffinity(0, allowed[:-reserved])  # the calling thread only; new threads inherit it
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, allowed)


def decode_input(
    decoder: msgspec.msgpack.Decoder, frame: bytes, reply: EngineCoreOutputs
) -> EngineCoreRequest | AbortRequests | UtilityCall | None:
    """The message in `frame`, or None: a request that does not decode as its type is refused (its id
    and the reason go into `reply.rejected`), anything else undecodable is logged and dropped. No
    client's input can end the core."""
    try:
        return decoder.decode(frame)
    except msgspec.MsgspecError as e:
        try:
            raw = msgspec.msgpack.decode(frame)
        except msgspec.MsgspecError:
            raw = None
        if isinstance(raw, list) and len(raw) > 1 and raw[0] == EngineCoreRequest.__name__ and isinstance(raw[1], str):
            reply.rejected.append((raw[1], f"invalid request: {e}"))
        else:
            print(f"engine core: dropped a message it cannot decode: {e}", file=sys.stderr)
        return None


def run_engine_core(launch: CoreLaunch, out: FrameWriter) -> None:
    """Build the core, send readiness (or the reason it could not start) on `out`, then serve the
    input pipe until terminated or until the frontend closes its end. Every output leaves through one
    sender thread (serve.core.loop_stream), which also streams the decode loops' tokens as they are made."""

    def send(msg: EngineCoreOutputs) -> None:
        try:
            out.send(msg)
        except BrokenPipeError:  # the frontend is gone: nobody is left to serve
            os._exit(0)

    try:
        start_xla_off_reserved_cores(launch.args.cpu_reserved_cores)
        stream = LoopTokenStream(send)
        core = build_core(launch.args, tuple(launch.eos_token_ids), launch.warmup, stream)
    except BaseException as e:
        out.send(StartupError(f"{type(e).__name__}: {e}"))
        raise
    out.send(
        EngineCoreReady(core.block_manager.num_blocks, core.max_model_len, core.vocab_size, list(core.eos_token_ids))
    )
    inp = FrameReader(launch.input_fd)
    inputs = decoders(Kind.REQUEST, Kind.ABORT, Kind.UTILITY)
    grammars = GrammarQueue(core)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()  # the start-up heap (model, compiled steps) is never garbage: full collections skip it (as vLLM)

    def take(msg: EngineCoreRequest | AbortRequests | UtilityCall, reply: EngineCoreOutputs) -> None:
        if isinstance(msg, EngineCoreRequest):
            try:
                if msg.params.structured_outputs is not None:
                    grammars.add(msg)  # joins the core once its grammar has compiled
                else:
                    core.add_request(msg)
            except Exception as e:  # a ValueError for bad input; anything else fails this request alone
                if not isinstance(e, ValueError):
                    traceback.print_exc(file=sys.stderr)
                reply.rejected.append((msg.request_id, str(e)))
        elif isinstance(msg, AbortRequests):
            grammars.abort(msg.request_ids)
            core.abort_requests(msg.request_ids, msg.sequences)
        else:
            try:
                result = EngineCoreOutputs(utility=(msg.call_id, None, core.utility(msg.method, msg.args)))
            except Exception as e:  # an AssertionError from an invariant check, say
                result = EngineCoreOutputs(utility=(msg.call_id, f"{type(e).__name__}: {e}", None))
            stream.send(result)

    try:
        while True:
            idle = not core.has_work()
            if idle and grammars:
                grammars.wait(GRAMMAR_POLL_S)
            elif idle:
                woke = inp.wait(IDLE_WAKE_MS / 1000)
                # Offers pulled or expired: the frontend's /metrics learns it. Polled on every idle wake, so
                # a client calling more often than IDLE_WAKE_MS does not starve it.
                if core.poll_kv_transfers():
                    stream.send(EngineCoreOutputs(stats=core.stats()))
                if not woke:
                    continue
            reply = EngineCoreOutputs(rejected=grammars.admit())
            arrived = False
            for kind, frame in inp.take():
                arrived = True
                if kind not in inputs:
                    print(f"engine core: dropped a {kind.name} frame, not an input", file=sys.stderr)
                elif (msg := decode_input(inputs[kind], frame, reply)) is not None:
                    take(msg, reply)
            if core.has_work():
                reply.outputs = core.step()
                reply.rejected += grammars.failed(reply.outputs)
            elif idle and not arrived and not reply.rejected:
                continue  # a grammar is still compiling, nothing else happened
            reply.stats = core.stats()
            reply.stats.num_waiting += len(grammars)
            stream.results(reply, core.applied_step)
    except EOFError:  # the frontend closed its end (or died writing a frame): nobody is left to serve
        pass
    except Exception:
        traceback.print_exc(file=sys.stderr)
        raise
    finally:
        stream.close()
        inp.close()


def main() -> None:
    """`python -c "from serve.core.core_proc import main; main()"` with a msgpack CoreLaunch on stdin."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    launch = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=CoreLaunch)
    exit_with_parent(launch.parent_pid)  # also during load and warm-up
    out = FrameWriter(launch.output_fd)
    start_heartbeat(out)
    run_engine_core(launch, out)
