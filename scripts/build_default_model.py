"""Rebuild the embedded default model from scratch: corpus -> BPE tokenizer -> `jaxinfra train` ->
Hugging Face folder in jaxinfra/default_model (with its measured held-out loss in metrics.json).
It starts from nothing: the recipe's out_dir (runs/default-model) is deleted first.

    python scripts/build_default_model.py [key=value overrides for the recipe]
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from fetch_kjv import fetch  # noqa: E402

from jaxinfra.data import split_corpus  # noqa: E402
from jaxinfra.loading import DEFAULT_MODEL_DIR  # noqa: E402
from jaxinfra.tokenizer import Tokenizer  # noqa: E402
from jaxinfra.train.config import RunConfig, load_run_config  # noqa: E402
from jaxinfra.train.loop import TrainResult, train  # noqa: E402

RECIPE = ROOT / "configs" / "train" / "default_model.yaml"
VOCAB_SIZE = 4096


def build(
    recipe: Path, overrides: list[str], dest: Path, prepare: Callable[[RunConfig], None] | None = None
) -> tuple[RunConfig, TrainResult, dict[str, float]]:
    """Train `recipe` from nothing (its out_dir deleted first; `prepare` runs before training) and
    install its Hugging Face folder as `dest`, with the measured held-out loss in metrics.json."""
    fetch()
    cfg = load_run_config(recipe, overrides)
    if Path(cfg.out_dir).exists():  # from scratch: never resume an older build's checkpoints
        print(f"removing the previous build in {cfg.out_dir}")
        shutil.rmtree(cfg.out_dir)
    if prepare is not None:
        prepare(cfg)
    result = train(cfg)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(Path(cfg.out_dir) / "hf", dest)
    metrics = {
        "steps": result.final_step,
        "tokens_trained": result.final_step * cfg.batch_size * cfg.data.seq_len,
        "heldout_loss": result.eval_loss,
        "heldout_perplexity": math.exp(result.eval_loss),
    }
    (dest / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return cfg, result, metrics


def train_tokenizer(cfg: RunConfig) -> None:
    """A BPE tokenizer on the training split only: the tokenizer never sees held-out text."""
    Tokenizer.train_bpe(split_corpus(cfg.data)["train"], VOCAB_SIZE).save(cfg.tokenizer)


def main(overrides: list[str]) -> None:
    cfg, result, metrics = build(RECIPE, overrides, DEFAULT_MODEL_DIR, train_tokenizer)
    metrics["unigram_entropy"] = result.unigram_entropy
    metrics["unigram_perplexity"] = math.exp(result.unigram_entropy)
    (DEFAULT_MODEL_DIR / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    shutil.copy(Path(cfg.out_dir) / "loss.png", DEFAULT_MODEL_DIR / "loss.png")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
