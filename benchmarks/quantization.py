"""Quantization quality on the embedded model: held-out KJV perplexity, weight bytes and greedy-token
agreement with float32 for RTN, AWQ, GPTQ (int4) and RTN / SmoothQuant (int8), in one run.

    python -m benchmarks.quantization [--out benchmarks/out]       (~4 minutes on 2 CPU cores)
    python -m benchmarks.quantization --quick                      (fixture excerpt, a few methods)

Calibration rows come from the KJV training split (data/kjv/kjv.txt: python scripts/fetch_kjv.py);
perplexity is measured on the held-out split the default model never saw (every 33rd chapter, as
configs/train/default_model.yaml holds it out), in 256-token windows. Agreement: 50 prompts of 16
held-out tokens, 32 greedy tokens each; "same" is the share of prompts whose continuation is identical,
"prefix" the mean share of tokens generated before the first difference.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

import jaxinfra
from jaxinfra.data import load_documents
from jaxinfra.data.pipeline import document_tokens
from jaxinfra.data.sources import split_documents
from jaxinfra.quant import QuantizedLinear
from jaxinfra.quant import decoder_linears as lin
from jaxinfra.quant.calibration import KJV_VALID_FRACTION
from jaxinfra.quant.quantize import QuantizeConfig, quantize_model

CORPUS = Path("data/kjv/kjv.txt")
EXCERPT = Path("tests/fixtures/kjv_excerpt.txt")
WINDOW, PROMPT, NEW = 256, 16, 32
METHODS: list[tuple[str, dict | None]] = [
    ("float32", None),
    ("int8 RTN (per channel)", dict(method="rtn", bits=8, group_size=0)),
    ("W8A8 SmoothQuant", dict(method="smoothquant", bits=8, group_size=0)),
    ("int4 g128 RTN", dict(method="rtn", bits=4)),
    ("int4 g128 AWQ", dict(method="awq", bits=4)),
    ("int4 g128 GPTQ", dict(method="gptq", bits=4, gptq_act_order=True)),
    ("int4 g128 RTN, zero points", dict(method="rtn", bits=4, symmetric=False)),
    ("int4 g128 AWQ, zero points", dict(method="awq", bits=4, symmetric=False)),
    ("int4 g128 GPTQ, zero points", dict(method="gptq", bits=4, symmetric=False, gptq_act_order=True)),
    ("int4 per-channel RTN", dict(method="rtn", bits=4, group_size=0)),
    ("int4 per-channel AWQ", dict(method="awq", bits=4, group_size=0)),
    ("int4 per-channel GPTQ", dict(method="gptq", bits=4, group_size=0, gptq_act_order=True)),
]
QUICK = ["float32", "int8 RTN (per channel)", "int4 g128 RTN", "int4 g128 GPTQ"]


def weight_bytes(model: jaxinfra.LlamaModel) -> tuple[int, int]:
    """(bytes of the decoder linears as stored, bytes of the whole model)."""
    linears = 0
    for layer in model.layers:
        for name in lin.LINEAR_NAMES:
            w = lin.get(layer, name)
            linears += w.nbytes if isinstance(w, QuantizedLinear) else w[...].nbytes
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    return linears, total


def perplexity(model: jaxinfra.LlamaModel, windows: jax.Array, batch: int = 16) -> float:
    forward = nnx.jit(lambda m, ids: m(ids))
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i : i + batch]
        logp = jax.nn.log_softmax(forward(model, ids)[:, :-1], axis=-1)
        nll -= float(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).sum())
        count += ids.shape[0] * (ids.shape[1] - 1)
    return math.exp(nll / count)


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    same = float(np.mean([a == b for a, b in zip(ours, ref)]))
    prefix = []
    for a, b in zip(ours, ref):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        prefix.append(k / len(b))
    return same, float(np.mean(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the fixture excerpt and four methods")
    parser.add_argument("--samples", type=int, default=128, help="calibration rows of 256 tokens")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args()
    corpus = EXCERPT if args.quick else CORPUS
    if not corpus.is_file():
        raise SystemExit(f"{corpus} is missing: python scripts/fetch_kjv.py")
    samples, n_prompts = (8, 8) if args.quick else (args.samples, args.prompts)
    tokenizer = jaxinfra.load_tokenizer()
    train, held = split_documents(load_documents([corpus]), KJV_VALID_FRACTION)
    stream = [t for doc in held for t in document_tokens(tokenizer, doc)]
    n_windows = len(stream) // WINDOW if not args.quick else 8
    windows = jnp.asarray(np.array(stream[: n_windows * WINDOW], np.int32).reshape(n_windows, WINDOW))
    starts = np.linspace(0, len(stream) - PROMPT - 1, n_prompts).astype(int)
    prompts = [stream[s : s + PROMPT] for s in starts]
    greedy = jaxinfra.GenerationConfig(max_new_tokens=NEW, stop_at_eos=False)
    print(f"held-out: {n_windows} windows of {WINDOW} tokens; calibration: {samples} rows of the training split")

    rows: list[dict] = []
    reference: list[list[int]] = []
    methods = [m for m in METHODS if not args.quick or m[0] in QUICK]
    for name, kwargs in tqdm(methods, desc="methods", unit="method"):
        t0 = time.perf_counter()
        model = jaxinfra.load_model()
        if kwargs is not None:
            cfg = QuantizeConfig(num_samples=samples, seq_len=WINDOW, **kwargs)
            quantize_model(model, tokenizer, cfg, documents=train)
        seconds = time.perf_counter() - t0
        tokens = jaxinfra.generate(model, prompts, greedy)
        reference = reference or tokens
        same, prefix = agreement(tokens, reference)
        linears, total = weight_bytes(model)
        rows.append(
            dict(
                method=name,
                perplexity=perplexity(model, windows),
                linear_bytes=linears,
                total_bytes=total,
                same=same,
                prefix=prefix,
                quantize_s=seconds,
            )
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantization.json").write_text(json.dumps(rows, indent=2))
    base = rows[0]["perplexity"]
    print("\n| method | held-out ppl | vs fp32 | linear weights | whole model | same greedy | greedy prefix | time |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f}% | "
            f"{r['linear_bytes'] / 2**20:.2f} MiB | {r['total_bytes'] / 2**20:.2f} MiB | {100 * r['same']:.0f}% | "
            f"{100 * r['prefix']:.0f}% | {r['quantize_s']:.0f} s |"
        )


if __name__ == "__main__":
    main()
