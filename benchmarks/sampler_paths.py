"""The sampler's cost per step for random rows at OpenAI's default settings (temperature 1, no top-k /
top-p: what guidellm and most clients send) against the full-vocabulary sort they used to take, in
one process: the baseline is the same rows with top-p 0.99999, whose support spans the vocabulary,
so the sampler has to sort. Vocabulary 4096 (the embedded model's).

    python -m benchmarks.sampler_paths [--rows 1 8 32 128] [--iters 20]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks.common import time_fn
from serve.core.sampler import sample, uniform_tensors

VOCAB = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    step = jax.jit(lambda logits, t: sample(logits, t).tokens)
    print(f"{'rows':>5} {'defaults ms':>12} {'full sort ms':>13} {'speed-up':>9}")
    for rows in args.rows:
        logits = jax.random.normal(jax.random.key(rows), (rows, VOCAB))
        seeds = np.arange(rows)
        defaults = uniform_tensors(rows, temperature=1.0, seed=seeds)
        sorting = uniform_tensors(rows, temperature=1.0, seed=seeds, top_p=0.99999)
        fast = time_fn(step, logits, defaults, iters=args.iters)
        slow = time_fn(step, logits, sorting, iters=args.iters)
        print(f"{rows:>5} {fast * 1e3:>12.2f} {slow * 1e3:>13.2f} {slow / fast:>8.1f}x")


if __name__ == "__main__":
    main()
