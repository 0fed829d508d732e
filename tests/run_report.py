"""The run's time against CI's budget: the 30 slowest files (setup, call and teardown summed, as the
workers spent it) and the wall time of the whole run, printed at its end and written to
test-artifacts/durations.json. A report for whoever adds the next slow file, never an assertion."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest

BUDGET_S = 25 * 60  # CI's pytest budget on a 2-core machine
SHOWN = 30
ARTIFACT = Path(__file__).resolve().parents[1] / "test-artifacts" / "durations.json"


class RunReport:
    """A plugin of the controller (xdist's workers' reports reach it too)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.files: collections.Counter[str] = collections.Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.files[report.nodeid.split("::", 1)[0]] += report.duration

    def pytest_terminal_summary(self, terminalreporter) -> None:
        wall = time.monotonic() - self.start
        worker = sum(self.files.values())
        tr = terminalreporter
        tr.section(f"the {SHOWN} slowest files (worker seconds)")
        for path, seconds in self.files.most_common(SHOWN):
            tr.write_line(f"{seconds:8.1f} s  {path}")
        tr.write_line(
            f"pytest wall time {wall:.0f} s against the {BUDGET_S} s budget ({wall / BUDGET_S:.0%}); "
            f"{worker:.0f} worker seconds over {len(self.files)} files"
        )
        ARTIFACT.parent.mkdir(exist_ok=True)
        ARTIFACT.write_text(json.dumps({"wall_s": round(wall, 1), "files": dict(self.files.most_common())}, indent=1))


def register(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(RunReport(), "jaxinfra-run-report")
