"""Training logs: a console progress bar, metrics.jsonl, TensorBoard event files, and loss.png."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from tqdm import tqdm


class MetricsLogger:
    """Writes on process 0 only; on a resume, records past the restored step are dropped first."""

    def __init__(self, out_dir: Path, total_steps: int, start_step: int, enabled: bool, progress: bool) -> None:
        self.enabled = enabled
        self.jsonl = out_dir / "metrics.jsonl"
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        kept = [
            line
            for line in (self.jsonl.read_text().splitlines() if self.jsonl.is_file() else [])
            if json.loads(line)["step"] <= start_step
        ]
        self.jsonl.write_text("".join(line + "\n" for line in kept))
        self.file = self.jsonl.open("a")
        self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress, dynamic_ncols=True
        )

    def log(self, step: int, split: str, metrics: Mapping[str, float | list[float]]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            if isinstance(v, list):  # per-expert loads: one scalar each
                for i, x in enumerate(v):
                    self.tb.add_scalar(f"{split}/{k}/{i}", x, step)
            else:
                self.tb.add_scalar(f"{split}/{k}", v, step)
        self.bar.set_postfix({f"{split}_loss": f"{metrics['loss']:.4f}"}, refresh=False)

    def advance(self, steps: int = 1) -> None:
        if self.enabled:
            self.bar.update(steps)

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.tb.close()
            self.file.close()


def read_metrics(jsonl: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]


def plot_losses(jsonl: str | Path, png: str | Path, reference: dict[str, float] | None = None) -> Path:
    """Train and eval loss against step, with horizontal reference lines (e.g. the unigram entropy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(jsonl)
    fig, ax = plt.subplots(figsize=(7, 4))
    for split, style in (("train", "-"), ("eval", "o-")):
        points = [(r["step"], r["loss"]) for r in records if r["split"] == split]
        if points:
            ax.plot(*zip(*points), style, label=f"{split} loss", markersize=3)
    for label, value in (reference or {}).items():
        ax.axhline(value, linestyle="--", color="gray")
        ax.text(0.01, value, f" {label} {value:.2f}", transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return Path(png)
