"""Prefix-cache hit rate of prefix-aware routing vs round robin across replicas (tiny model, CPU,
one process): `--prefixes` shared prefixes x `--per-prefix` requests (each the prefix plus a short
suffix of its own, in shuffled order, `--wave` at a time), sent to `--replicas` in-process engines
by each router; the engines' own prefix-cache counters give the hit rates.

python -m benchmarks.prefix_routing [--replicas 4] [--prefixes 4] [--per-prefix 20]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import jaxinfra
from serve import EngineArgs, LLMEngine, SamplingParams
from serve.scale.prefix_router import PrefixAwareRouter, RoundRobinRouter

MODEL = "tiny-llama"
BLOCK = 16


def workload(prefixes: int, per_prefix: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 256, prefix_len).tolist() for _ in range(prefixes)]
    prompts = [heads[p] + rng.integers(0, 256, 8).tolist() for p in range(prefixes) for _ in range(per_prefix)]
    return [prompts[i] for i in rng.permutation(len(prompts))]


def replicas_of(n: int) -> list[LLMEngine]:
    """`n` engines on one tiny model (each compiles its own steps)."""
    model, tok = jaxinfra.load_model(MODEL), jaxinfra.load_tokenizer(MODEL)
    args = EngineArgs(
        model=MODEL,
        block_size=BLOCK,
        max_model_len=128,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        num_gpu_blocks_override=128,
        compilation_cache_dir="",
    )
    return [LLMEngine(model, tok, args) for _ in range(n)]


def hit_rate(router: RoundRobinRouter, prompts: list[list[int]], engines: list[LLMEngine], wave: int) -> dict:
    """Route `prompts` in waves of `wave` concurrent requests to `engines` (their prefix caches
    emptied first); returns the replicas' pooled prefix-cache hit rate."""
    before = []
    for e in engines:
        e.core.block_manager.reset_prefix_cache()
        before.append(e.stats())
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for start in range(0, len(prompts), wave):
        owner = {}
        for i, prompt in enumerate(prompts[start : start + wave], start):
            r = router.choose(prompt)
            engines[r].add_request(f"req-{i}", prompt, params)
            owner[f"req-{i}"] = r
        while any(e.has_unfinished_requests() for e in engines):
            for e in engines:
                if e.has_unfinished_requests():
                    for out in e.step():
                        if out.finished:
                            router.finished(owner[out.request_id])
    after = [e.stats() for e in engines]
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before))
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before))
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--per-prefix", type=int, default=20)
    p.add_argument("--prefix-len", type=int, default=96)
    p.add_argument("--wave", type=int, default=8)
    a = p.parse_args()
    prompts = workload(a.prefixes, a.per_prefix, a.prefix_len)
    engines = replicas_of(a.replicas)
    rr = hit_rate(RoundRobinRouter(a.replicas), prompts, engines, a.wave)
    aware = hit_rate(PrefixAwareRouter(a.replicas, BLOCK, max_num_seqs=16), prompts, engines, a.wave)
    print(json.dumps({"round_robin": rr, "prefix_aware": aware}, indent=1))
    print(
        f"{a.prefixes} prefixes x {a.per_prefix} requests on {a.replicas} replicas: prefix-cache hit rate "
        f"{rr['hit_rate']:.3f} round robin, {aware['hit_rate']:.3f} prefix-aware "
        f"({aware['hit_rate'] / rr['hit_rate']:.2f}x)"
    )


if __name__ == "__main__":
    main()
