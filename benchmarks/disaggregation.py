"""Prefill/decode disaggregation vs one colocated engine: long prompts arriving while short requests
decode. Reports the short requests' inter-token latency (P50/P99; idle = the short requests alone),
and the KV transfer time (prefill side's save + decode side's load) as a fraction of prefill time.

Colocated: one engine core takes everything (long prompts' chunks share steps with the decodes).
Disaggregated: a prefill core on a thread of its own computes the long prompts and offers their
blocks over shared memory; the decode core (this thread) pulls them and decodes. Both setups use
the same devices (on CPU: the same cores), so the comparison is at equal total compute. Each setup
runs once to compile, then is timed.

python -m benchmarks.disaggregation [--model tiny-qwen3] [--long-prompts 6] [--long-len 384] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import threading
import time
from pathlib import Path

import numpy as np

import jaxinfra
from serve import EngineArgs, SamplingParams
from serve.core.engine_core import EngineCore
from serve.types import EngineCoreRequest


def engine_args(model: str, role: str | None) -> EngineArgs:
    kv = None if role is None else {"kv_role": role}
    return EngineArgs(
        model=model,
        block_size=16,
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=256,
        compilation_cache_dir="",
        kv_transfer_config=kv,
    )


class Scenario:
    """Short requests decoding from t=0; long prompts arriving every `interval_s`."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        rng = np.random.default_rng(0)
        self.short = [rng.integers(0, vocab, args.short_len).tolist() for _ in range(args.short_requests)]
        self.long = [rng.integers(0, vocab, args.long_len).tolist() for _ in range(args.long_prompts)]
        self.short_tokens = args.short_tokens
        self.interval_s = args.interval_s

    def request(self, rid: str, prompt: list[int], max_tokens: int, kv: dict | None = None) -> EngineCoreRequest:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return EngineCoreRequest(rid, prompt, params, 0, time.monotonic(), kv_transfer_params=kv)


def itl_stats(arrivals: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
    """P50/P99 of the gaps between a request's consecutive tokens (a burst's gap split over its tokens)."""
    gaps = []
    for times in arrivals.values():
        for (t0, _), (t1, n) in itertools.pairwise(times):
            gaps += [(t1 - t0) / n] * n
    return {"itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)), "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99))}


def run(decode: EngineCore, scenario: Scenario, prefill: EngineCore | None, with_long: bool) -> dict:
    """Step `decode` until every request is done; long prompts go to `prefill` (its own thread) when
    given, else to `decode` itself. Returns the short requests' ITL and the prefill core's step time
    (its saves included)."""
    tag = f"{time.monotonic_ns()}"
    for i, p in enumerate(scenario.short):
        decode.add_request(scenario.request(f"s{i}-{tag}", p, scenario.short_tokens))
    arrivals: dict[str, list[tuple[float, int]]] = {}
    pulled: queue.Queue = queue.Queue()
    prefill_time = [0.0]
    longs = list(enumerate(scenario.long)) if with_long else []
    start = time.monotonic()

    def prefill_loop() -> None:
        assert prefill is not None
        pending = list(longs)
        while pending or prefill.has_work():
            while pending and time.monotonic() - start >= pending[0][0] * scenario.interval_s:
                i, p = pending.pop(0)
                prefill.add_request(scenario.request(f"l{i}-{tag}", p, 1, {"do_remote_decode": True}))
            if not prefill.has_work():
                time.sleep(0.001)
                continue
            t0 = time.perf_counter()
            outs = prefill.step()
            prefill_time[0] += time.perf_counter() - t0
            for o in outs:
                if o.kv_transfer_params is not None:
                    pulled.put((o.request_id, o.kv_transfer_params))

    thread = threading.Thread(target=prefill_loop) if prefill is not None and longs else None
    if thread is not None:
        thread.start()
    waiting, done_long = list(longs), 0
    while decode.has_work() or done_long < len(longs):
        if thread is None:
            while waiting and time.monotonic() - start >= waiting[0][0] * scenario.interval_s:
                i, p = waiting.pop(0)
                decode.add_request(scenario.request(f"l{i}-{tag}", p, 4))
        while not pulled.empty():
            rid, kv = pulled.get()
            decode.add_request(scenario.request(rid, scenario.long[int(rid[1:].split("-")[0])], 4, kv))
        if not decode.has_work():
            time.sleep(0.001)
            continue
        outs = decode.step()
        now = time.monotonic()
        for o in outs:
            if o.request_id.startswith("s") and o.new_token_ids:
                arrivals.setdefault(o.request_id, []).append((now, len(o.new_token_ids)))
            if o.request_id.startswith("l") and o.finish_reason is not None:
                done_long += 1
    if thread is not None:
        thread.join()
    return {**itl_stats(arrivals), "seconds": time.monotonic() - start, "prefill_step_s": prefill_time[0]}


def transfer_seconds(*cores: EngineCore) -> float:
    total = 0.0
    for core in cores:
        stats = core.stats().kv_transfer
        total += sum(stats.xfer_sum.values()) if stats is not None else 0.0
    return total


def compilations(*cores: EngineCore) -> int:
    return sum(core.runner.num_compilations for core in cores)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--short-requests", type=int, default=4)
    p.add_argument("--short-len", type=int, default=16)
    p.add_argument("--short-tokens", type=int, default=96)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--long-len", type=int, default=384)
    p.add_argument("--interval-s", type=float, default=0.3, help="seconds between long prompts' arrivals")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args()

    model = jaxinfra.load_model(args.model)
    scenario = Scenario(args, model.cfg.vocab_size)
    colocated = EngineCore(model, engine_args(args.model, None))
    prefill = EngineCore(model, engine_args(args.model, "kv_producer"))
    decode = EngineCore(model, engine_args(args.model, "kv_consumer"))
    results = {}
    for name, (dec, pre, with_long) in {
        "idle": (colocated, None, False),
        "colocated": (colocated, None, True),
        "disaggregated": (decode, prefill, True),
    }.items():
        run(dec, scenario, pre, with_long)  # compile every shape
        before = transfer_seconds(prefill, decode)
        compiled = compilations(colocated, prefill, decode)
        results[name] = run(dec, scenario, pre, with_long)
        results[name]["transfer_s"] = transfer_seconds(prefill, decode) - before
        results[name]["compilations"] = compilations(colocated, prefill, decode) - compiled  # in the timed run
    dis = results["disaggregated"]
    summary = {
        "p99_itl_colocated_over_idle": results["colocated"]["itl_p99_ms"] / results["idle"]["itl_p99_ms"],
        "p99_itl_disaggregated_over_idle": dis["itl_p99_ms"] / results["idle"]["itl_p99_ms"],
        "p99_itl_disaggregated_over_colocated": dis["itl_p99_ms"] / results["colocated"]["itl_p99_ms"],
        "transfer_over_prefill_time": dis["transfer_s"] / dis["prefill_step_s"],
    }
    print(
        f"{'setup':<15}{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'prefill core s':>16}{'transfer s':>12}{'wall s':>9}"
        f"{'compiles':>10}"
    )
    for name, r in results.items():
        print(
            f"{name:<15}{r['itl_p50_ms']:>12.1f}{r['itl_p99_ms']:>12.1f}{r['prefill_step_s']:>16.2f}"
            f"{r['transfer_s']:>12.3f}{r['seconds']:>9.1f}{r['compilations']:>10}"
        )
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "disaggregation.json").write_text(json.dumps({"args": vars(args), **results, **summary}, indent=1))


if __name__ == "__main__":
    main()
