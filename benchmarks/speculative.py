"""Speculative decoding (n-gram, the embedded model's trained draft and its EAGLE head) vs none on the embedded
model, KJV continuation prompts, greedy: mean acceptance length (1 + accepted / drafts) and TPOT at
several batch sizes, every engine in this process on the same prompts (each batch run once to
compile, then timed --repeats times, engines interleaved, the fastest run kept).

python -m benchmarks.speculative [--quick] [--k 3] [--methods ngram draft_model eagle] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxinfra.loading import DEFAULT_DRAFT_NAME, DEFAULT_EAGLE_NAME, DEFAULT_MODEL
from serve import EngineArgs, LLMEngine, SamplingParams

KJV = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kjv_excerpt.txt"


def kjv_prompts(n: int, verses: int = 4) -> list[str]:
    """n passages of a few consecutive verses, spread over the excerpt, to be continued."""
    lines = [line for line in KJV.read_text().splitlines() if len(line.split()) > 3]
    starts = np.linspace(0, len(lines) - verses - 1, n).astype(int)
    return ["\n".join(lines[s : s + verses]) + "\n" for s in starts]


def run_batch(eng: LLMEngine, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once; mean TPOT (first to last token over tokens after the first), tokens/s."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="final_only")
    stats0 = eng.stats().spec_decoding
    drafts0, accepted0 = (stats0.num_drafts, stats0.num_accepted_tokens) if stats0 else (0, 0)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    seconds = time.perf_counter() - t0
    tpot = []
    for o in done:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is not None and m.first_token_time is not None and m.last_token_time is not None and n > 1:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1))
    stats = eng.stats().spec_decoding
    drafts = (stats.num_drafts - drafts0) if stats else 0
    accepted = (stats.num_accepted_tokens - accepted0) if stats else 0
    return {
        "tpot_ms": 1e3 * float(np.mean(tpot)),
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in done) / seconds,
        "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "drafts": drafts,
        "tokens": [o.outputs[0].token_ids for o in sorted(done, key=lambda o: int(o.request_id.split("-")[1]))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 4, 16 tokens")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--methods", nargs="+", default=["ngram", "draft_model", "eagle"], choices=["ngram", "draft_model", "eagle"]
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculation off above this many running requests (default: never; see --auto-off)",
    )
    parser.add_argument("--auto-off", action="store_true", help="the config's default disable_by_batch_size")
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed runs per engine and batch, interleaved; the fastest kept"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    batches = [1, 4] if args.quick else args.batches
    max_tokens = 16 if args.quick else args.max_tokens
    base = dict(
        model=DEFAULT_MODEL,
        max_model_len=256,  # the embedded model's context
        max_num_seqs=max(batches),
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        compilation_cache_dir="",
    )
    auto_off = {} if args.auto_off else {"disable_by_batch_size": args.disable_by_batch_size}
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4},
        "draft_model": {"method": "draft_model", "model": DEFAULT_DRAFT_NAME, "num_speculative_tokens": args.k},
        "eagle": {"method": "eagle", "model": DEFAULT_EAGLE_NAME, "num_speculative_tokens": args.k},
    }
    specs = {name: {**spec, **auto_off} for name, spec in specs.items()}
    engines = {"off": LLMEngine.from_engine_args(EngineArgs(**base))}
    for method in args.methods:
        engines[method] = LLMEngine.from_engine_args(EngineArgs(**base, speculative_config=specs[method]))
    rows = []
    for b in batches:
        prompts = kjv_prompts(b)
        for eng in engines.values():
            run_batch(eng, prompts, max_tokens)  # compiles this batch's shapes
        runs: dict[str, list[dict]] = {mode: [] for mode in engines}
        order = list(engines)
        for r in range(args.repeats):  # interleaved, so a busy spell hits them all; who goes first rotates
            for mode in order[r % len(order) :] + order[: r % len(order)]:
                runs[mode].append(run_batch(engines[mode], prompts, max_tokens))
        res = {mode: min(rs, key=lambda r: r["tpot_ms"]) for mode, rs in runs.items()}
        row: dict = {"batch": b, "tpot_ms_off": res["off"]["tpot_ms"], "tokens_per_s_off": res["off"]["tokens_per_s"]}
        line = f"batch {b:3d}: TPOT off {row['tpot_ms_off']:.1f} ms"
        for method in args.methods:
            r = res[method]
            row[method] = {
                "tpot_ms": r["tpot_ms"],
                "tpot_ratio": res["off"]["tpot_ms"] / r["tpot_ms"],
                "acceptance_length": r["acceptance_length"],
                "tokens_per_s": r["tokens_per_s"],
                "greedy_identical": r["tokens"] == res["off"]["tokens"],
            }
            m = row[method]
            line += (
                f"; {method} {m['tpot_ms']:.1f} ms (off/{method} {m['tpot_ratio']:.2f}x, acceptance length "
                f"{m['acceptance_length']:.2f}, greedy identical: {m['greedy_identical']})"
            )
        rows.append(row)
        print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(
        json.dumps({"k": args.k, "max_tokens": max_tokens, **auto_off, "repeats": args.repeats, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
