"""benchmarks/gpu_check.sh on CPU (--cpu-dry-run: every step at tiny shapes), and the budget contract its
benchmarks keep: no new row past --budget, and every row in the area JSON as soon as it is measured."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks.budget import Recorder

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/gpu_check.sh"


def _check(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run gpu_check.sh with OUT=out and this interpreter."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "WHEELS": str(out / "no-wheels")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _steps() -> dict[str, str]:
    """step -> area, from --list."""
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0]: line.split()[2] for line in listed.splitlines() if "opt-in" not in line}


def _summary_steps(out: Path) -> list[str]:
    """The step names in summary.md's steps table."""
    text = (out / "summary.md").read_text().split("## Steps", 1)[1].split("\n## ", 1)[0]
    return [
        line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "| step |" not in line
    ]


def test_cpu_dry_run_runs_every_step_into_six_files(tmp_path):
    r = _check(tmp_path, "--cpu-dry-run", timeout=900)
    assert r.returncode == 0, r.stdout.split("## Steps")[-1][:3000] + r.stderr[-2000:]
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert len(files) <= 6 and "summary.md" in files and "logs.tar.gz" in files, files
    steps = _steps()
    assert sorted(_summary_steps(tmp_path)) == sorted(steps)
    for step, area in steps.items():
        entry = json.loads((tmp_path / f"{area}.json").read_text())[step]
        assert entry["status"] == "ok" and len(entry["rows"]) >= 1, (step, entry)
    serving = json.loads((tmp_path / "serving.json").read_text())["serving"]["rows"]
    assert {"start, empty compile cache", "start, warm compile cache"} <= {row["phase"] for row in serving}
    assert any(row.get("output_tokens_per_s", 0) > 0 for row in serving)
    leftovers = json.loads((tmp_path / "system.json").read_text())["leftovers"]["rows"]
    assert all(row["clean"] for row in leftovers)
    _check_benchmark_files(tmp_path / "logs.tar.gz", tmp_path / "unpacked")


def _check_benchmark_files(archive: Path, into: Path) -> None:
    """What the benchmarks the dry run ran wrote themselves (art/) and printed (logs/<step>.log)."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    art, logs = into / "art", into / "logs"
    ours = [row for row in json.loads((art / "attention.json").read_text())["rows"] if row["impl"] == "ours"]
    assert len(ours) == 2 and all(row["max_err"] < 2e-2 and row["fwd_ms"] > 0 for row in ours)
    assert (art / "attention.png").stat().st_size > 1000
    assert "measured matmul peak" in (logs / "attention.log").read_text()
    paged = json.loads((art / "paged_attention.json").read_text())
    ours = [row for row in paged["decode"] if row["impl"] == "ours"]
    assert {row["kv"] for row in ours} == {"bf16", "int8", "fp8"} and all(row["max_err"] < 2e-2 for row in ours)
    assert paged["prefill"][0]["max_err"] < 2e-2 and (art / "paged_attention.png").is_file()
    assert paged["prefill"][0]["flash_us"] > 0  # timed against our flash forward at the same shape
    rows = json.loads((art / "quant_matmul.json").read_text())
    assert [row["m"] for row in rows] == [1, 16][: len(rows)] and rows  # M=16 only if the budget had room
    assert all(row[f"{name}_err"] < 2e-2 for row in rows for name in ("w4a16", "w8a16", "w8a8"))
    assert all(row["xla_int4_fusion"] in ("fused", "materialized") for row in rows)
    assert (art / "quant_matmul.png").stat().st_size > 1000 and "W4A16" in (logs / "quant_matmul.log").read_text()
    train = json.loads((art / "train_throughput.json").read_text())
    assert train["tokens_per_s"] > 0 and train["mfu"] > 0 and "MFU" in (logs / "train_throughput.log").read_text()


def test_only_runs_one_step(tmp_path):
    r = _check(tmp_path, "--cpu-dry-run", "--only", "collectives", timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert _summary_steps(tmp_path) == ["collectives"]
    assert list(json.loads((tmp_path / "kernels.json").read_text())) == ["collectives"]
    assert not (tmp_path / "serving.json").exists() and (tmp_path / "logs.tar.gz").is_file()


def test_unknown_step_is_refused(tmp_path):
    r = _check(tmp_path, "--only", "nonesuch", timeout=30)
    assert r.returncode == 2 and "no step nonesuch" in r.stderr


def test_recorder_refuses_a_row_that_would_pass_the_budget(tmp_path):
    rec = Recorder(budget=10.0, rows=tmp_path / "a.json", step="s")
    assert rec.more(estimate=1.0)
    rec.add({"x": 1})
    rec.start -= 9.5
    assert not rec.more(estimate=1.0) and not rec.more(estimate=0.0)
    entry = json.loads((tmp_path / "a.json").read_text())["s"]
    assert entry["rows"] == [{"x": 1}] and "budget of 10 s" in entry["budget_stop"]


def test_benchmark_stops_at_its_budget_with_the_rows_it_has(tmp_path):
    area = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "benchmarks.quant_matmul", "--quick", "--budget", "1", "--rows", str(area)]
    r = subprocess.run(cmd + ["--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    entry = json.loads(area.read_text())["quant_matmul"]
    assert len(entry["rows"]) == 1 and "budget of 1 s" in entry["budget_stop"]  # the quick run has 2 rows


def test_rows_are_written_as_measured(tmp_path):
    """A benchmark killed mid-run keeps the rows it measured before."""
    area = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "benchmarks.collectives", "--quick", "--rows", str(area), "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    rows: list = []
    while not rows and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        try:
            rows = json.loads(area.read_text())["collectives"]["rows"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    kept = json.loads(area.read_text())["collectives"]["rows"]
    assert 1 <= len(kept) < 30 and all(row["us"] > 0 for row in kept)  # 5 ops x 6 sizes when it runs out


def test_kernel_tests_stop_at_the_budget_and_count_what_ran(tmp_path):
    area = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "benchmarks.kernel_tests", "--budget", "0.5", "--rows", str(area)]
    r = subprocess.run(
        [*cmd, "tests/kernels/test_attention_reference.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:]
    (row,) = json.loads(area.read_text())["kernel_tests"]["rows"]
    assert row["passed"] == 1 and row["failed"] == 0 and row["not_run"] == row["collected"] - 1 > 0


def test_long_context_step_dry_run(tmp_path):
    r = _check(tmp_path, "--cpu-dry-run", "--only", "serving_128k", timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = json.loads((tmp_path / "serving.json").read_text())["serving_128k"]["rows"]
    assert [row["phase"] for row in rows] == ["start", "448-token prompt", "second question, same document"]
    long, again = rows[1], rows[2]
    assert long["ttft_ms"] > 0 and long["prefill_tflops"] > 0 and long["tpot_ms"] > 0
    assert again["ttft_over_first"] == pytest.approx(again["ttft_ms"] / long["ttft_ms"])
