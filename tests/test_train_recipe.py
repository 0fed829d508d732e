"""The tiny CPU recipe learns real text: on an excerpt of the King James Bible (every 8th chapter, a
committed fixture) the held-out loss ends well below the unigram entropy of the training split's tokens."""

from pathlib import Path

import pytest

from jaxinfra.train.config import load_run_config
from jaxinfra.train.logger import read_metrics
from jaxinfra.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
KJV_EXCERPT = ROOT / "tests" / "fixtures" / "kjv_excerpt.txt"


@pytest.mark.slow
def test_tiny_recipe_learns_the_kjv(tmp_path):
    cfg = load_run_config(
        ROOT / "configs" / "train" / "tiny-cpu.yaml",
        [f"out_dir={tmp_path}", f"data.paths=[{KJV_EXCERPT}]", "export_hf=false"],
    )
    result = train(cfg, progress=False)
    evals = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "eval"]
    assert evals[0] > evals[-1] and result.eval_loss == evals[-1]
    assert result.eval_loss < result.unigram_entropy - 0.5, (result.eval_loss, result.unigram_entropy)
    assert (tmp_path / "loss.png").stat().st_size > 10_000
