"""What every training run shares, whatever it trains: its data (loaders and the corpus's unigram
entropy) and its step loop, which logs a window of steps at a time and evaluates on a schedule.
`train()` (the model or its adapters) and `train_eagle()` (a draft head) both run on it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax

from jaxinfra.data import DataLoader, split_corpus, unigram_entropy
from jaxinfra.data.pipeline import document_tokens
from jaxinfra.tokenizer import Tokenizer
from jaxinfra.train.config import RunConfig
from jaxinfra.train.logger import MetricsLogger

Metrics = dict[str, jax.Array]
# (the window's fetched step metrics, the window's last step, its seconds) -> its logged record
WindowRecord = Callable[[list[dict[str, Any]], int, float], dict[str, Any]]


@dataclasses.dataclass
class RunData:
    """The run's training batches, its held-out batches (None without a held-out split), and the
    unigram entropy of the training split (nats/token: the loss a model with no context reaches)."""

    train: DataLoader
    valid: DataLoader | None
    entropy: float

    @classmethod
    def open(cls, cfg: RunConfig, tokenizer: Tokenizer, rows: int) -> RunData:
        corpus = split_corpus(cfg.data)
        train = DataLoader(cfg.data, tokenizer, rows, "train", corpus["train"])
        valid = DataLoader(cfg.data, tokenizer, rows, "valid", corpus["valid"]) if corpus["valid"] else None
        entropy = unigram_entropy(document_tokens(tokenizer, d)[1:] for d in corpus["train"][:5000])
        return cls(train, valid, entropy)

    def close(self) -> None:
        self.train.close()
        if self.valid is not None:
            self.valid.close()


def run_steps(
    cfg: RunConfig,
    start: int,
    logger: MetricsLogger,
    step: Callable[[int], Metrics],
    record: WindowRecord,
    evaluate: Callable[[], dict[str, float]] | None,
    after: Callable[[int], None] | None = None,
    window_ends: Callable[[int], bool] = lambda done: False,
) -> dict[str, float]:
    """Steps `start`..cfg.steps. Metrics stay on the device until a window closes (every log_every
    steps, at the last and wherever `window_ends`), then are fetched once and logged as `record`
    makes them; `evaluate` runs every eval_every steps and at the last; `after(done)` follows each
    step (checkpoints). Returns the last evaluation ({} if none ran)."""
    pending: list[Metrics] = []
    evaluation: dict[str, float] = {}
    tic = time.perf_counter()
    for i in range(start, cfg.steps):
        pending.append(step(i))
        done = i + 1
        close = done % cfg.log_every == 0 or done == cfg.steps or window_ends(done)
        if close:
            fetched = jax.device_get(pending)
            logger.log(done, "train", record(fetched, i, time.perf_counter() - tic))
            pending = []
        logger.advance()
        if evaluate is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
            evaluation = evaluate()
            logger.log(done, "eval", evaluation)
        if after is not None:
            after(done)
        if close:
            tic = time.perf_counter()
    return evaluation
