"""Embeddings per second, ours (LLM.embed, --runner pooling) against sentence-transformers on the same
machine and checkpoint (the default model, mean pooling, normalized, float32), one timed run each
after a warm-up; the texts are the KJV excerpt cut to about `tokens` tokens each.

python -m benchmarks.embeddings [--texts 512] [--tokens 128] [--quick] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer, models

from jaxinfra.loading import DEFAULT_MODEL_DIR, load_tokenizer
from serve import LLM
from serve.core.pooling.runner import MIN_LENGTH, bucket

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kjv_excerpt.txt"


def texts(n: int, tokens: int) -> list[str]:
    """`n` texts of about `tokens` tokens (with BOS): consecutive windows of the corpus, wrapped."""
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    ids = tok.encode(CORPUS.read_text(), add_special_tokens=False)
    step = tokens - 1
    return [tok.decode([ids[(i * step + j) % len(ids)] for j in range(step)]) for i in range(n)]


def plain_checkpoint(directory: Path) -> Path:
    """The default model in `directory` (weights linked) with no chat template and a pad token, so
    sentence-transformers embeds plain text (it renders chat-capable tokenizers' templates)."""
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (directory / name).symlink_to(DEFAULT_MODEL_DIR / name)
    special = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    special.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps({**special, "pad_token": special["eos_token"]}))
    return directory


def timed(fn, batch: list[str]) -> tuple[float, np.ndarray]:
    fn(batch[:8])  # warm-up: compiles our batch shapes' smallest and loads torch's kernels
    start = time.perf_counter()
    out = fn(batch)
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="texts a batch, both sides")
    p.add_argument("--quick", action="store_true", help="32 texts of 32 tokens (a smoke run)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = p.parse_args()
    n, length = (32, 32) if args.quick else (args.texts, args.tokens)
    batch = texts(n, length)
    with tempfile.TemporaryDirectory(prefix="embeddings-bench-") as tmp:
        result = measure(batch, plain_checkpoint(Path(tmp)), args.batch, length)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embeddings.json").write_text(json.dumps(result, indent=2))
    print(
        f"{n} texts x {result['tokens_per_text']:.0f} tokens: ours {result['ours_per_s']:.1f}/s, "
        f"sentence-transformers {result['sentence_transformers_per_s']:.1f}/s, ratio {result['ratio']:.2f}x "
        f"(min cosine {result['min_cosine']:.6f})"
    )


def measure(batch: list[str], checkpoint: Path, batch_size: int, length: int) -> dict:
    """Both sides' embeddings per second over `batch`, and the least cosine between their vectors."""
    st = SentenceTransformer(
        modules=[models.Transformer(str(checkpoint)), models.Pooling(256, "mean"), models.Normalize()],
        device="cpu",
    )
    llm = LLM(
        str(checkpoint),
        runner="pooling",
        pooler_config={"pooling_type": "MEAN", "normalize": True},
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=batch_size
        * bucket(length, MIN_LENGTH),  # as many rows a batch as sentence-transformers'
        compilation_cache_dir="",
    )
    llm.embed(batch)  # compiles every batch shape the timed run uses
    ours_s, ours = timed(lambda b: np.array([o.outputs.embedding for o in llm.embed(b)]), batch)
    st_s, ref = timed(lambda b: st.encode(b, batch_size=batch_size, convert_to_numpy=True), batch)
    n = len(batch)
    return {
        "texts": n,
        "tokens_per_text": float(np.mean([len(st.tokenizer(t)["input_ids"]) for t in batch])),
        "ours_per_s": n / ours_s,
        "sentence_transformers_per_s": n / st_s,
        "ratio": st_s / ours_s,
        "min_cosine": float(np.min(np.sum(ours * ref, axis=-1))),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    main()
