"""A 128K-token prompt served beside running streams (issue 49 items 2-3), offline engine on this machine:

- the long prompt's TTFT (chunked prefill), and a second question on the same document (prefix cache);
- the process's resident memory before it and at its peak;
- the other streams' TPOT (mean gap between their tokens) while it prefills, against their idle TPOT;
- the engine core's host time per step (step wall time less the wait for the device, and the main
  thread's CPU time) with the streams alone, while the prompt prefills, and with its 128K sequence
  decoding in the batch.

The model is the `tiny-llama-128k` preset (one layer, one head of dimension 8, 131,072 positions).
Every step shape is compiled before the streams start, so no gap counts a compile. Single steps (no
decode loops), so each step is timed on its own. The prefill cap runs as the engine resolves it (query-key
pairs from the model's FLOP ratio) unless `--pairs-per-token` says otherwise (0: tokens only).

    python -m benchmarks.long_context [--prompt-len 131048] [--streams 4] [--prefill-per-decode 2]
        [--pairs-per-token model 0]   # a run each
    python -m benchmarks.long_context --quick   # a 4K-token prompt: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import numpy as np

import jaxinfra
from serve import EngineArgs, LLMEngine, SamplingParams

MODEL = "tiny-llama-128k"
CHUNK = 1024  # max_num_batched_tokens: a step's tokens
QUESTION = 1000  # tokens after the shared document in each long prompt
STREAM_PROMPT, STREAM_TOKENS = 32, 256  # each stream request's prompt and output tokens


def rss_bytes() -> int:
    """The process's resident memory now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Recorder:
    """Steps the engine and records each step's host time and each request's token arrival times; keeps
    `streams` requests running, each STREAM_PROMPT prompt tokens and STREAM_TOKENS output tokens, a
    new one in the place of each that finishes (so their contexts, and their own decode cost, stay the
    same whether the long prompt is there or not)."""

    def __init__(self, eng: LLMEngine, streams: int, rng: np.random.Generator) -> None:
        self.eng = eng
        self.rng = rng
        self.arrivals: dict[str, list[float]] = {}
        self.host: list[float] = []
        self.cpu: list[float] = []
        self.added: dict[str, float] = {}  # each stream request's arrival
        self.started = 0
        for _ in range(streams):
            self.start_stream()

    def start_stream(self) -> None:
        prompt = self.rng.integers(0, self.eng.core.vocab_size, STREAM_PROMPT).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True, output_kind="delta")
        rid = f"stream{self.started}"
        self.eng.add_request(rid, prompt, params)
        self.added[rid] = time.perf_counter()
        self.started += 1

    def step(self) -> None:
        core = self.eng.core
        cpu0 = time.thread_time()
        outputs = self.eng.step()
        self.cpu.append(time.thread_time() - cpu0)
        self.host.append(core.step_time - core.step_wait)
        now = time.perf_counter()
        for out in outputs:
            self.arrivals.setdefault(out.request_id, []).extend([now] * len(out.outputs[0].token_ids))
            if out.finished and out.request_id.startswith("stream"):
                self.start_stream()

    def mark(self) -> tuple[int, float]:
        """Where the recording stands: (steps so far, time)."""
        return len(self.host), time.perf_counter()

    def stream_stats(self, start: float, end: float) -> dict[str, float]:
        """The streams' gaps between consecutive tokens of a request that arrived within [start, end]: mean
        (TPOT) and median, in seconds (a step shape's first use compiles it: the mean counts those stalls);
        and the mean TTFT of the stream requests whose first token arrived then, and how many did."""
        gaps, ttfts = [], []
        for rid, arrivals in self.arrivals.items():
            if rid.startswith("stream"):
                gaps.extend(np.diff([t for t in arrivals if start <= t <= end]).tolist())
                if start <= arrivals[0] <= end:
                    ttfts.append(arrivals[0] - self.added[rid])
        stats = {"tpot_s": float(np.mean(gaps)), "median_gap_s": float(np.median(gaps))}
        return {**stats, "stream_ttft_s": float(np.mean(ttfts)) if ttfts else float("nan"), "stream_starts": len(ttfts)}

    def host_ms(self, first: int, last: int) -> dict[str, float]:
        """Median host wall and CPU milliseconds per step over steps [first, last)."""
        return {
            "host_ms": 1e3 * statistics.median(self.host[first:last]),
            "cpu_ms": 1e3 * statistics.median(self.cpu[first:last]),
        }


def run_until(rec: Recorder, rid: str, tokens: int) -> float:
    """Step until request `rid` has `tokens` output tokens; the time it got there."""
    while len(rec.arrivals.get(rid, [])) < tokens:
        rec.step()
    return rec.arrivals[rid][tokens - 1]


def measure(
    prompt_len: int, streams: int, per_decode: int, pairs: int | None, idle_steps: int, max_len: int = 131_072
) -> dict:
    """One run: warm-up, the streams alone, the long prompt's prefill and decode beside them, then a
    second question on its document."""
    eng = LLMEngine(
        jaxinfra.load_model(MODEL),
        None,
        EngineArgs(
            model=MODEL,
            block_size=16,
            max_model_len=max_len,
            max_num_seqs=8,
            max_num_batched_tokens=CHUNK,
            num_gpu_blocks_override=max_len // 16 + 64 * streams,
            prefill_tokens_per_decode=per_decode,
            prefill_pairs_per_token=pairs,
            scan_layers=False,
            compilation_cache_dir="",
        ),
    )
    eng.core.runner.warmup()
    rng = np.random.default_rng(0)
    vocab = eng.core.vocab_size
    document = rng.integers(0, vocab, prompt_len - QUESTION).tolist()
    questions = [rng.integers(0, vocab, QUESTION).tolist() for _ in range(2)]
    rec = Recorder(eng, streams, rng)
    for _ in range(STREAM_TOKENS):  # the streams' starts spread over a request's length
        rec.step()
    first, start = rec.mark()
    for _ in range(idle_steps):
        rec.step()
    last, end = rec.mark()
    idle = {**rec.stream_stats(start, end), **rec.host_ms(first, last)}
    rss_before = rss_bytes()

    long_params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, output_kind="delta")
    first, start = rec.mark()
    eng.add_request("long", document + questions[0], long_params)
    ttft = run_until(rec, "long", 1) - start
    last, end = rec.mark()
    prefill = {**rec.stream_stats(start, end), "steps": last - first, **rec.host_ms(first, last)}
    first, _ = rec.mark()
    run_until(rec, "long", 16)
    last, _ = rec.mark()
    long_decode = rec.host_ms(first + 1, last)  # the step that took its first token back is prefill's
    peak_rss = peak_rss_bytes()

    _, start = rec.mark()
    eng.add_request("again", document + questions[1], long_params)
    ttft_again = run_until(rec, "again", 1) - start
    cached = eng.core.block_manager.prefix_hits
    for rid in list(eng.core.requests):
        eng.abort_request(rid)
    return {
        "prompt_len": prompt_len,
        "streams": streams,
        "prefill_tokens_per_decode": per_decode,
        "prefill_pairs_per_token": eng.core.layout.pairs_per_token,
        "ttft_s": ttft,
        "ttft_second_question_s": ttft_again,
        "prefix_hit_tokens": cached,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": peak_rss,
        "idle": idle,
        "during_prefill": prefill,
        "long_decoding": long_decode,
    }


def table(r: dict) -> str:
    """The result as the markdown table RESULTS.md keeps."""
    idle, pre, dec = r["idle"], r["during_prefill"], r["long_decoding"]
    gib = 2**30
    rss = f"{r['rss_before_bytes'] / gib:.2f} / {r['peak_rss_bytes'] / gib:.2f} GiB"
    rows = [
        ("long prompt TTFT", f"{r['ttft_s']:.1f} s ({r['prompt_len']:,} tokens, {pre['steps']} steps)"),
        ("second question on the same document: TTFT", f"{r['ttft_second_question_s']:.3f} s"),
        ("second / first TTFT", f"{r['ttft_second_question_s'] / r['ttft_s']:.2%}"),
        ("RSS before the long prompt / peak", rss),
        ("other streams' TPOT (median gap) idle", f"{1e3 * idle['tpot_s']:.1f} ({1e3 * idle['median_gap_s']:.1f}) ms"),
        (
            "other streams' TPOT (median gap) during the prefill",
            f"{1e3 * pre['tpot_s']:.1f} ({1e3 * pre['median_gap_s']:.1f}) ms",
        ),
        ("during / idle", f"{pre['tpot_s'] / idle['tpot_s']:.1f}x"),
        (
            "new stream requests' TTFT (count) idle / during the prefill",
            f"{1e3 * idle['stream_ttft_s']:.1f} ({idle['stream_starts']}) / "
            f"{1e3 * pre['stream_ttft_s']:.1f} ({pre['stream_starts']}) ms",
        ),
        ("host ms/step (wall, CPU): streams alone", f"{idle['host_ms']:.2f}, {idle['cpu_ms']:.2f}"),
        ("host ms/step (wall, CPU): during the prefill", f"{pre['host_ms']:.2f}, {pre['cpu_ms']:.2f}"),
        ("host ms/step (wall, CPU): the long sequence decoding", f"{dec['host_ms']:.2f}, {dec['cpu_ms']:.2f}"),
    ]
    return "\n".join(["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=131_048)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument(
        "--prefill-per-decode", type=int, nargs="+", default=[2], help="prefill_tokens_per_decode: a run each"
    )
    parser.add_argument(
        "--pairs-per-token",
        nargs="+",
        default=["model"],
        help="prefill_pairs_per_token: 'model' (the engine's default) or an int, 0 = tokens only; a run each",
    )
    parser.add_argument("--idle-steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a 4K-token prompt (max_model_len 8K), 20 idle steps")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    results = []
    for per_decode in args.prefill_per_decode:
        for text in args.pairs_per_token:
            pairs = None if text == "model" else int(text)
            if args.quick:
                results.append(measure(4096, args.streams, per_decode, pairs, 20, max_len=8192))
            else:
                results.append(measure(args.prompt_len, args.streams, per_decode, pairs, args.idle_steps))
            r = results[-1]
            title = f"prefill_tokens_per_decode {per_decode}, prefill_pairs_per_token {r['prefill_pairs_per_token']}"
            print(f"\n{title}:\n{table(r)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_context.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
