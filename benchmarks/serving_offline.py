"""Offline serving benchmark (tiny model, runs on CPU), all in one process:

1. throughput of continuous batching vs static batching (same engine; a static batch is admitted
   only when the previous one has fully finished) on outputs of widely varying length;
2. time to first token with and without prefix caching, prompts sharing a long prefix;
3. host time per engine-core step with 256 running requests (the whole step minus the device wait),
   and the frontend's output processing of it.

python -m benchmarks.serving_offline [--quick] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import jaxinfra
from serve import EngineArgs, LLMEngine, SamplingParams

MODEL = "tiny-llama"


def _engine(model, tokenizer, **kwargs) -> LLMEngine:
    args = dict(
        model=MODEL,
        block_size=16,
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=1024,
    )
    return LLMEngine(model, tokenizer, EngineArgs(**{**args, **kwargs}))


def _workload(n: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(0, 256, int(rng.integers(8, 32))).tolist()
        length = int(rng.choice([4, 8, 16, 32, 384], p=[0.3, 0.3, 0.2, 0.14, 0.06]))  # most short, a few very long
        out.append(
            (prompt, SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True, output_kind="final_only"))
        )
    return out


def throughput(model, tokenizer, n: int, batch: int) -> dict:
    work = _workload(n)
    eng = _engine(model, tokenizer, max_num_seqs=batch)
    eng.core.runner.warmup()
    results = {}
    for mode in ("continuous", "static"):
        t0 = time.perf_counter()
        tokens = 0
        groups = [work] if mode == "continuous" else [work[i : i + batch] for i in range(0, n, batch)]
        for g, group in enumerate(tqdm(groups, desc=mode, leave=False)):
            for i, (prompt, params) in enumerate(group):
                eng.add_request(f"{mode}-{g}-{i}", prompt, params)
            while eng.has_unfinished_requests():
                tokens += sum(len(o.outputs[0].token_ids) for o in eng.step() if o.finished)
        seconds = time.perf_counter() - t0
        results[mode] = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
    results["ratio"] = results["continuous"]["tokens_per_s"] / results["static"]["tokens_per_s"]
    return results


def ttft(model, tokenizer, n: int, prefix_len: int) -> dict:
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 256, prefix_len).tolist()
    prompts = [prefix + rng.integers(0, 256, 8).tolist() for _ in range(n + 1)]
    results = {}
    for caching in (True, False):
        eng = _engine(model, tokenizer, enable_prefix_caching=caching, max_num_batched_tokens=1024, max_num_seqs=8)
        eng.core.runner.warmup()
        times = []
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            eng.add_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            while eng.has_unfinished_requests():
                eng.step()
            times.append(time.perf_counter() - t0)
        results["cached" if caching else "uncached"] = float(np.mean(times[1:]))  # the first one fills the cache
    results["ratio"] = results["cached"] / results["uncached"]
    return results


def host_overhead(model, tokenizer, running: int, steps: int) -> dict:
    """Host time per step with `running` decoding requests: the whole EngineCore.step() minus the time
    it waits for the device; and the frontend's output processing (detokenizing) of that step."""
    eng = _engine(
        model,
        tokenizer,
        max_num_seqs=running,
        max_num_batched_tokens=max(512, running),
        num_gpu_blocks_override=running * 8,
    )
    rng = np.random.default_rng(2)
    for i in range(running):
        eng.add_request(
            f"h{i}",
            rng.integers(0, 256, 16).tolist(),
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1000, ignore_eos=True, seed=i, output_kind="delta"),
        )
    core = eng.core
    eng.core.runner.warmup()
    while core.scheduler.waiting or any(s.num_computed_tokens < s.prompt_len for s in core.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    host, frontend = [], []
    for _ in range(steps):
        outs = core.step()
        host.append(core.step_time - core.step_wait)
        t0 = time.perf_counter()
        eng.output_processor.process(outs)
        frontend.append(time.perf_counter() - t0)
    assert core.stats().num_running == running
    return {
        "running": running,
        "ms_per_step_median": 1e3 * float(np.median(host)),
        "ms_per_step_p90": 1e3 * float(np.percentile(host, 90)),
        "frontend_ms_per_step_median": 1e3 * float(np.median(frontend)),
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    tp = res["throughput"]
    a.bar(["static", "continuous"], [tp["static"]["tokens_per_s"], tp["continuous"]["tokens_per_s"]])
    a.set_ylabel("output tokens / s")
    a.set_title(f"batching (continuous/static = {tp['ratio']:.2f}x)")
    t = res["ttft"]
    b.bar(["no prefix cache", "prefix cache"], [1e3 * t["uncached"], 1e3 * t["cached"]])
    b.set_ylabel("mean TTFT (ms)")
    b.set_title(f"shared-prefix TTFT (cached/uncached = {t['ratio']:.2f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    model, tokenizer = jaxinfra.load_model(MODEL), jaxinfra.load_tokenizer(MODEL)
    res = {
        "throughput": throughput(model, tokenizer, n=32 if args.quick else 128, batch=8 if args.quick else 32),
        "ttft": ttft(model, tokenizer, n=3 if args.quick else 8, prefix_len=256 if args.quick else 480),
        "host_overhead": host_overhead(model, tokenizer, running=256, steps=5 if args.quick else 30),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving_offline.json").write_text(json.dumps(res, indent=2))
    plot(res, args.out / "serving_offline.png")
    tp, t, h = res["throughput"], res["ttft"], res["host_overhead"]
    print(
        f"\ncontinuous batching: {tp['continuous']['tokens_per_s']:.1f} tok/s   static: "
        f"{tp['static']['tokens_per_s']:.1f} tok/s   ratio {tp['ratio']:.2f}x (target >= 2x)"
    )
    print(
        f"TTFT shared prefix: cached {1e3 * t['cached']:.1f} ms   uncached {1e3 * t['uncached']:.1f} ms   "
        f"ratio {t['ratio']:.2f}x (target <= 0.3x)"
    )
    print(
        f"engine-core host time/step with {h['running']} running (step minus device wait): median "
        f"{h['ms_per_step_median']:.3f} ms, p90 {h['ms_per_step_p90']:.3f} ms (target < 1 ms); frontend output "
        f"processing {h['frontend_ms_per_step_median']:.3f} ms/step"
    )


if __name__ == "__main__":
    main()
