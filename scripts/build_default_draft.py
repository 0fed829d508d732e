"""Rebuild the embedded model's speculative draft: `jaxinfra train` on configs/train/default_draft.yaml
(the default model's corpus and tokenizer) -> Hugging Face folder in jaxinfra/default_draft, with its
measured held-out loss in metrics.json. It starts from nothing: the recipe's out_dir is deleted first.

    python scripts/build_default_draft.py [key=value overrides for the recipe]
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from fetch_kjv import fetch  # noqa: E402

from jaxinfra.loading import DEFAULT_DRAFT_DIR  # noqa: E402
from jaxinfra.train.config import load_run_config  # noqa: E402
from jaxinfra.train.loop import train  # noqa: E402

RECIPE = ROOT / "configs" / "train" / "default_draft.yaml"


def main(overrides: list[str]) -> None:
    fetch()
    cfg = load_run_config(RECIPE, overrides)
    if Path(cfg.out_dir).exists():  # from scratch: never resume an older build's checkpoints
        print(f"removing the previous build in {cfg.out_dir}")
        shutil.rmtree(cfg.out_dir)
    result = train(cfg)
    if DEFAULT_DRAFT_DIR.exists():
        shutil.rmtree(DEFAULT_DRAFT_DIR)
    shutil.copytree(Path(cfg.out_dir) / "hf", DEFAULT_DRAFT_DIR)
    metrics = {
        "steps": result.final_step,
        "tokens_trained": result.final_step * cfg.batch_size * cfg.data.seq_len,
        "heldout_loss": result.eval_loss,
        "heldout_perplexity": math.exp(result.eval_loss),
    }
    (DEFAULT_DRAFT_DIR / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
