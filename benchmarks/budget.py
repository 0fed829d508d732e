"""A benchmark's time budget and its rows saved as they are measured (benchmarks/gpu_check.sh's contract).

A step of the GPU check gives its benchmark `--budget S`: before each new row the benchmark asks
`Recorder.more()`, which says no once the seconds spent (since the step started: $GPU_CHECK_STEP_START,
so imports and compiles count) plus the last row's cost would pass the budget. `--rows FILE` names
the area JSON (kernels.json, training.json, ...) the step shares with others: each row is written to it
as soon as it is measured, under the step's name, so a step killed from outside keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any


def add_budget_args(parser: argparse.ArgumentParser, step: str) -> None:
    """The flags every budgeted benchmark takes: --budget, --rows, --step."""
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds after which no new row starts")
    parser.add_argument("--rows", type=Path, default=None, help="area JSON to write each row to as it is measured")
    parser.add_argument("--step", default=step, help="this run's name in the area JSON")


def update_area(path: Path, step: str, **fields: Any) -> None:
    """Set `fields` of `step`'s entry in the area JSON at `path` (read, change, atomic replace)."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault(step, {"rows": []}).update(fields)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


class Recorder:
    """Budget clock plus row sink: `more()` before each row, `add(row)` after it."""

    def __init__(self, budget: float = math.inf, rows: Path | None = None, step: str = "bench") -> None:
        started = os.environ.get("GPU_CHECK_STEP_START")
        self.start = float(started) if started else time.time()
        self.budget, self.path, self.step = budget, rows, step
        self.rows: list[dict[str, Any]] = []
        self.last_cost = 0.0
        self._mark = time.time()
        self.stopped = False
        if rows is not None:
            rows.parent.mkdir(parents=True, exist_ok=True)
            update_area(rows, step, rows=[], budget_s=budget if math.isfinite(budget) else None)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Recorder:
        """A recorder from the flags add_budget_args added."""
        return cls(args.budget, args.rows, args.step)

    def elapsed(self) -> float:
        """Seconds since the step started."""
        return time.time() - self.start

    def more(self, estimate: float | None = None) -> bool:
        """Whether a new row fits: elapsed + its estimated cost (default: the last row's) within budget.
        The first `False` is printed and noted in the area JSON; it stays `False` after that."""
        cost = self.last_cost if estimate is None else estimate
        if not self.stopped and self.elapsed() + cost > self.budget:
            self.stopped = True
            note = f"budget of {self.budget:.0f} s reached after {self.elapsed():.1f} s: no new rows"
            print(note, flush=True)
            self.note(budget_stop=note)
        return not self.stopped

    def add(self, row: dict[str, Any]) -> None:
        """Keep a measured row and write it to the area JSON now."""
        now = time.time()
        self.last_cost, self._mark = now - self._mark, now
        self.rows.append(row)
        if self.path is not None:
            update_area(self.path, self.step, rows=self.rows)

    def note(self, **fields: Any) -> None:
        """Step-level facts (peak TFLOP/s, copy bandwidth, skipped rows) beside the rows."""
        if self.path is not None:
            update_area(self.path, self.step, **fields)
