"""The benchmark scripts run end to end (tiny shapes on CPU), so the GPU suite does not rot. Those that
benchmarks/gpu_check.sh runs (attention, paged attention, quantized matmuls, training throughput) are
checked on its dry run's files instead (tests/test_gpu_check.py), not run twice."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[1]


def _run_quick(module: str, out: Path) -> subprocess.CompletedProcess[str]:
    """Run `python -m benchmarks.<module> --quick --out <out>` and insist it succeeds."""
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_cpu_paged_attention_benchmark_quick(tmp_path):
    r = _run_quick("cpu_paged_attention", tmp_path)
    result = json.loads((tmp_path / "cpu_paged_attention.json").read_text())
    impls = {row["impl"] for row in result["rows"]}
    assert impls == {"cpu", "xla", "jnp_gather"} and all(row["ms"] > 0 for row in result["rows"])
    assert result["copy_gbs"] > 0 and "vs xla" in r.stdout and (tmp_path / "cpu_paged_attention.png").is_file()


def test_decode_bandwidth_targets():
    from benchmarks.paged_attention import bandwidth_target

    assert bandwidth_target(32, 4096) == 0.85 and bandwidth_target(256, 4096) == 0.85
    assert bandwidth_target(8, 32768) == 0.60 and bandwidth_target(64, 512) == 0.60
    assert bandwidth_target(1, 32768) is None


def test_quantization_benchmark_quick(tmp_path):
    r = _run_quick("quantization", tmp_path)
    rows = {row["method"]: row for row in json.loads((tmp_path / "quantization.json").read_text())}
    assert rows["float32"]["same"] == 1.0 and rows["float32"]["perplexity"] > 1
    assert rows["int4 g128 RTN"]["linear_bytes"] < rows["float32"]["linear_bytes"] / 7
    assert rows["int8 RTN (per channel)"]["perplexity"] < rows["float32"]["perplexity"] * 1.01
    assert "| int4 g128 GPTQ |" in r.stdout


def test_collectives_benchmark_on_8_cpu_devices(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives", "--cpu-devices", "8", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "collectives.json").read_text())
    assert {row["op"] for row in rows} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"}
    assert all(row["devices"] == 8 and row["busbw"] > 0 for row in rows)
    ar = next(row for row in rows if row["op"] == "all_reduce")
    assert ar["busbw"] == ar["algbw"] * 2 * 7 / 8
    assert "collectives over 8 cpu device(s)" in r.stdout


def test_embeddings_benchmark_quick(tmp_path):
    r = _run_quick("embeddings", tmp_path)
    result = json.loads((tmp_path / "embeddings.json").read_text())
    assert result["min_cosine"] >= 0.9999 and result["ours_per_s"] > 0 and result["sentence_transformers_per_s"] > 0
    assert "ratio" in r.stdout


def test_multi_lora_benchmark_quick(tmp_path):
    r = _run_quick("multi_lora", tmp_path)
    result = json.loads((tmp_path / "multi_lora.json").read_text())
    rates = result["throughput"]["tokens_per_s"]
    assert len(rates) == 3 and all(rate > 0 for rate in rates.values())
    assert result["load"]["read_s"] > 0 and result["load"]["to_slot_s"] > 0
    assert "adapters / base" in r.stdout
