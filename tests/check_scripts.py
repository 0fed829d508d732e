"""Run a test-side script as `python -m tests.…` from the repository root, so that it imports the
`tests` package and the project's own packages, never a same-named installed distribution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_check(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m module args…` in a fresh interpreter (its own jax flags and device count), output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
