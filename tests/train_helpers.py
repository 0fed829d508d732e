"""A small real-text corpus and a tiny run config for training-loop tests."""

from pathlib import Path

import numpy as np
import yaml

VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
    "And God called the light Day, and the darkness he called Night.",
    "And the evening and the morning were the first day.",
]


def write_corpus(path: Path, num_docs: int = 120, seed: int = 0) -> Path:
    """Documents of 1-4 verses, blank-line separated."""
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(VERSES, size=int(rng.integers(1, 5)))) for _ in range(num_docs)]
    path.write_text("\n\n".join(docs) + "\n")
    return path


def tiny_run_config(tmp: Path, out: str = "run", **overrides) -> dict:
    """A dict for RunConfig: tiny-llama, byte-level tokens, 32-token rows."""
    cfg = {
        "model": "tiny-llama",
        "out_dir": str(tmp / out),
        "steps": 12,
        "batch_size": 4,
        "data": {
            "paths": [str(write_corpus(tmp / "corpus.txt"))],
            "valid_fraction": 0.1,
            "seq_len": 32,
            "packing_bins": 4,
        },
        "optim": {"learning_rate": 3e-3, "warmup_steps": 3},
        "compute_dtype": "float32",
        "checkpoint": {"every": 3, "keep": 2},
        "eval_every": 5,
        "eval_batches": 2,
        "log_every": 1,
    }
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path
