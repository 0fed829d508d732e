"""The kernel tests inside a time budget, counted as they run (the kernel_tests step of gpu_check.sh).

    python -m benchmarks.kernel_tests --budget 60 --rows kernels.json [pytest args, default tests/kernels]

Runs pytest in this process without -x: every failure is counted, not only the first. After each test
the counts (passed, failed, skipped, errors) and the failing test ids are written to the area JSON,
and once the budget is spent pytest stops starting tests (as -x would) with what it has: the exit
status then says whether any test that ran failed, and the row how many did not run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pytest

from benchmarks.budget import Recorder, add_budget_args


class BudgetPlugin:
    """Counts outcomes into the recorder's one row as tests end; stops the session at the budget."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "collected": 0}
        self.failures: list[str] = []
        self.session: Any = None

    def pytest_sessionstart(self, session: Any) -> None:
        self.session = session

    def pytest_collection_finish(self, session: Any) -> None:
        self.counts["collected"] = len(session.items)
        self._save()

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            key = {"passed": "passed", "skipped": "skipped"}.get(report.outcome)
            key = key or ("failed" if report.when == "call" else "errors")
            self.counts[key] += 1
            if key in ("failed", "errors"):
                errors = [ln[1:].strip() for ln in report.longreprtext.splitlines() if ln.startswith("E ")]
                self.failures.append(f"{report.nodeid}: {' / '.join(errors[:3])}"[:300])
            self._save()
        if report.when == "teardown" and not self.rec.more(estimate=report.duration):
            self.session.shouldstop = "budget spent"

    def _save(self) -> None:
        done = sum(self.counts[k] for k in ("passed", "failed", "skipped", "errors"))
        row = {**self.counts, "not_run": max(self.counts["collected"] - done, 0), "seconds": self.rec.elapsed()}
        self.rec.rows[:] = [row]
        self.rec.note(rows=self.rec.rows, failures=self.failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_budget_args(parser, "kernel_tests")
    args, rest = parser.parse_known_args()
    plugin = BudgetPlugin(Recorder.from_args(args))
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(rest or ["tests/kernels"])], plugins=[plugin])
    if plugin.rec.stopped and code == pytest.ExitCode.INTERRUPTED:  # stopped by the budget, not by a failure
        code = pytest.ExitCode.TESTS_FAILED if plugin.failures else pytest.ExitCode.OK
    sys.exit(int(code))


if __name__ == "__main__":
    main()
