"""Rebuild the embedded model's speculative draft: `jaxinfra train` on configs/train/default_draft.yaml
(the default model's corpus and tokenizer) -> Hugging Face folder in jaxinfra/default_draft, with its
measured held-out loss in metrics.json. It starts from nothing: the recipe's out_dir is deleted first.

    python scripts/build_default_draft.py [key=value overrides for the recipe]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from build_default_model import build

from jaxinfra.loading import DEFAULT_DRAFT_DIR

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "train" / "default_draft.yaml"


def main(overrides: list[str]) -> None:
    print(json.dumps(build(RECIPE, overrides, DEFAULT_DRAFT_DIR)[2], indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
