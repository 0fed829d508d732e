"""Multi-LoRA serving on the embedded default model (offline LLM engine, runs on CPU):

1. decode throughput of 64 sequences, each with its own adapter (64 adapters of rank `--rank` on the
   `--lora-target-modules` projections, all by default, which the engine's lora_target_modules matches;
   max_loras 64), against the same 64 sequences on an engine without LoRA, and on the LoRA engine with
   no adapter (what enabling LoRA costs by itself); the runs alternate, medians reported;
2. adapter load time: a PEFT folder read into host memory, copied into a device slot, and (with --http)
   POST /v1/load_lora_adapter on a running server, which does the read in its engine core.

python -m benchmarks.multi_lora [--rank 8] [--tokens 128] [--repeats 3] [--lora-target-modules q_proj,v_proj]
    [--http] [--quick] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxinfra
from jaxinfra.loading import DEFAULT_MODEL
from jaxinfra.lora import LoraConfig, add_lora, lora_layers, save_peft
from jaxinfra.lora.config import TARGET_MODULES
from serve import LLM, EngineArgs, LoRARequest, SamplingParams
from serve.core.lora import AdapterSlots, read_adapter
from serve.core.sequence import Sequence

PROMPT_LEN = 16


def make_adapters(root: Path, count: int, rank: int, targets: tuple[str, ...]) -> list[LoRARequest]:
    """`count` PEFT adapters of `rank` on the `targets` projections of the default model, random A and B."""
    model = add_lora(jaxinfra.load_model(DEFAULT_MODEL), LoraConfig(rank, 2.0 * rank, 0.0, targets), nnx.Rngs(0))
    rng = np.random.default_rng(0)
    requests = []
    for i in range(count):
        for _, w in lora_layers(model):
            w.lora_a.value = jnp.asarray(0.05 * rng.standard_normal(w.lora_a.shape), w.lora_a.dtype)
            w.lora_b.value = jnp.asarray(0.05 * rng.standard_normal(w.lora_b.shape), w.lora_b.dtype)
        save_peft(model, root / f"adapter-{i}")
        requests.append(LoRARequest(f"adapter-{i}", i + 1, str(root / f"adapter-{i}")))
    return requests


def engine_args(seqs: int, tokens: int, lora: bool, rank: int, targets: tuple[str, ...] = TARGET_MODULES) -> dict:
    """configs/serve/cpu.yaml's step settings for `seqs` sequences of PROMPT_LEN + `tokens` tokens."""
    blocks = seqs * -(-(PROMPT_LEN + tokens) // 16) + 16
    args = dict(
        model=DEFAULT_MODEL,
        block_size=16,
        max_model_len=PROMPT_LEN + tokens + 16,
        max_num_seqs=seqs,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=blocks,
        num_scheduler_steps=8,
        scan_layers=False,
        enable_prefix_caching=False,
    )
    lora_args = {"enable_lora": True, "max_loras": seqs, "max_lora_rank": rank, "lora_target_modules": targets}
    return {**args, **lora_args} if lora else args


def decode_rate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], tokens: int, tag: str) -> float:
    """Output tokens per second once every sequence has its first token (the prompts are done), to the end."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    made: dict[str, int] = {}
    start = start_tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            made[out.request_id] = len(out.outputs[0].token_ids)
        if start is None and len(made) == len(prompts) and all(made.values()):
            start, start_tokens = time.perf_counter(), sum(made.values())
    assert start is not None and start_tokens is not None
    seconds = time.perf_counter() - start
    assert sum(made.values()) == len(prompts) * tokens
    return (sum(made.values()) - start_tokens) / seconds


def throughput(
    requests: list[LoRARequest], seqs: int, tokens: int, rank: int, repeats: int, targets: tuple[str, ...]
) -> dict:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 4096, PROMPT_LEN).tolist() for _ in range(seqs)]
    base = LLM(**engine_args(seqs, tokens, False, rank))
    with_lora = LLM(**engine_args(seqs, tokens, True, rank, targets))
    runs = {
        "base model, enable_lora off": (base, [None] * seqs),
        f"{seqs} adapters, one per sequence": (with_lora, requests[:seqs]),
        "enable_lora on, no adapter": (with_lora, [None] * seqs),
    }
    for name, (llm, loras) in runs.items():  # warm-up: compiles every shape the timed runs meet
        decode_rate(llm, prompts, loras, tokens, f"warm-{name}")
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(repeats):
        for name, (llm, loras) in runs.items():
            rates[name].append(decode_rate(llm, prompts, loras, tokens, f"{r}-{name}"))
            print(f"  run {r}: {name}: {rates[name][-1]:.0f} tokens/s", flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    base_rate = medians["base model, enable_lora off"]
    return {
        "tokens_per_s": medians,
        "runs": rates,
        "ratio_adapters_vs_base": medians[f"{seqs} adapters, one per sequence"] / base_rate,
        "ratio_lora_on_no_adapter_vs_base": medians["enable_lora on, no adapter"] / base_rate,
    }


def load_times(requests: list[LoRARequest], rank: int, targets: tuple[str, ...]) -> dict:
    """Median seconds to read a PEFT folder into host memory, and to copy it into a free device slot
    (the first copy, which compiles, left out)."""
    cfg = jaxinfra.load_model(DEFAULT_MODEL).cfg
    slots = AdapterSlots(cfg, len(requests), rank, len(requests), targets)
    read, copy = [], []
    params = SamplingParams(max_tokens=1)
    for req in requests:
        t0 = time.perf_counter()
        slots.host[req.lora_int_id] = read_adapter(req, cfg, rank, targets)
        t1 = time.perf_counter()
        slots.slots([Sequence(req.lora_name, 0, [1], params, 0, None, (0, 0.0), "", 1.0, req)])
        jax.block_until_ready(slots.pools)
        read.append(t1 - t0)
        copy.append(time.perf_counter() - t1)
    return {"read_s": statistics.median(read), "to_slot_s": statistics.median(copy[1:]), "first_to_slot_s": copy[0]}


@contextlib.contextmanager
def http_server(rank: int, slots: int) -> Iterator[str]:
    """A server on the default model with LoRA on (its engine core in a child process), on a free port."""
    import uvicorn

    from serve.engine.async_engine import AsyncEngine
    from serve.http.app import build_app

    engine = AsyncEngine(EngineArgs(**engine_args(slots, 16, True, rank)), warmup=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="base"), port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


def http_load_times(requests: list[LoRARequest], rank: int) -> dict:
    """Median seconds of POST /v1/load_lora_adapter (the core reads the folder; the answer comes once it is
    ready), and of the first completion with each adapter (its copy into a slot, a prompt and one token)."""
    loads, first = [], []
    with http_server(rank, len(requests)) as url, httpx.Client(base_url=url, timeout=120) as client:
        client.post("/v1/completions", json={"model": "base", "prompt": "In", "max_tokens": 1}).raise_for_status()
        for req in requests:
            t0 = time.perf_counter()
            body = {"lora_name": req.lora_name, "lora_path": req.lora_path}
            client.post("/v1/load_lora_adapter", json=body).raise_for_status()
            t1 = time.perf_counter()
            body = {"model": req.lora_name, "prompt": "In", "max_tokens": 1}
            client.post("/v1/completions", json=body).raise_for_status()
            loads.append(t1 - t0)
            first.append(time.perf_counter() - t1)
    return {"load_route_s": statistics.median(loads), "first_request_s": statistics.median(first[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seqs", type=int, default=64, help="sequences, each with its own adapter")
    p.add_argument("--tokens", type=int, default=128, help="output tokens a sequence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--lora-target-modules", default="all", help="the adapters' projections and the engine's (comma-separated)"
    )
    p.add_argument("--http", action="store_true", help="also time the load route on a running server")
    p.add_argument("--quick", action="store_true", help="4 sequences of 8 tokens, one repeat (a smoke run)")
    p.add_argument("--out", default="benchmarks/out")
    a = p.parse_args()
    if a.quick:
        a.seqs, a.tokens, a.repeats = 4, 8, 1
    targets = EngineArgs(lora_target_modules=a.lora_target_modules).lora_modules()
    with tempfile.TemporaryDirectory() as tmp:
        requests = make_adapters(Path(tmp), a.seqs, a.rank, targets)
        result = {
            "rank": a.rank,
            "lora_target_modules": list(targets),
            "seqs": a.seqs,
            "tokens": a.tokens,
            "throughput": throughput(requests, a.seqs, a.tokens, a.rank, a.repeats, targets),
            "load": load_times(requests, a.rank, targets),
        }
        if a.http:
            result["http"] = http_load_times(requests[: min(8, a.seqs)], a.rank)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_lora.json").write_text(json.dumps(result, indent=2))
    t = result["throughput"]
    print(f"\ndecode, {a.seqs} sequences x {a.tokens} tokens, rank {a.rank} on {','.join(targets)}:")
    for name, rate in t["tokens_per_s"].items():
        print(f"  {name:40s} {rate:9.0f} tokens/s")
    print(f"  adapters / base: {t['ratio_adapters_vs_base']:.2f}x (target >= 0.8x)")
    print(f"  enable_lora on, no adapter / base: {t['ratio_lora_on_no_adapter_vs_base']:.2f}x")
    load = result["load"]
    print(f"adapter load: folder -> host {load['read_s'] * 1e3:.1f} ms, host -> slot {load['to_slot_s'] * 1e3:.1f} ms")
    if a.http:
        h = result["http"]
        print(
            f"  POST /v1/load_lora_adapter {h['load_route_s'] * 1e3:.1f} ms, first request after it "
            f"{h['first_request_s'] * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
