"""gpu_check.sh's bookkeeping, without jax: each step's status in its area JSON, summary.md built from
the area JSONs (after every step, so a cut-off run still has one), and the check that no process of
the run is left behind (nvidia-smi's compute apps, and any process carrying the run's marker).

    python -m benchmarks.gpu_report status --out OUT --area kernels --step attention --rc 0 --started T0 --budget 30
    python -m benchmarks.gpu_report summary --out OUT
    python -m benchmarks.gpu_report leftovers --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.budget import update_area

AREAS = ("system", "kernels", "training", "serving")


def record_status(out: Path, area: str, step: str, rc: int, started: float, budget: float, skipped: str) -> None:
    """Write how the step ended (and its seconds since `started`, a Unix time) into its area JSON entry."""
    seconds = time.time() - started if started else 0.0
    if skipped:
        state = f"skipped: {skipped}"
    elif rc == 0:
        state = "ok"
    elif rc in (124, 137):
        state = f"killed by the outer timeout (rc {rc})"
    else:
        state = f"failed (rc {rc})"
    update_area(out / f"{area}.json", step, status=state, rc=rc, seconds=round(seconds, 1), budget_s=budget)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | dict):
        return json.dumps(value)[:80]
    return str(value).replace("|", "/").replace("\n", " ")[:120]


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return lines


def load_areas(out: Path) -> dict[str, dict[str, Any]]:
    """Every area JSON under `out` that parses, in AREAS order."""
    areas = {}
    for area in AREAS:
        path = out / f"{area}.json"
        if path.is_file():
            areas[area] = json.loads(path.read_text())
    return areas


def build_summary(out: Path) -> str:
    """summary.md's text: a table of the steps, then one table of rows per step, by area."""
    areas = load_areas(out)
    lines = [f"# GPU check ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "", "## Steps", ""]
    steps = [
        {"step": step, "area": area, "status": e.get("status", "running or killed"), "seconds": e.get("seconds", "")}
        | {"budget_s": e.get("budget_s", ""), "rows": len(e.get("rows", []))}
        for area, data in areas.items()
        for step, e in data.items()
    ]
    lines += _table(steps) if steps else ["(no step has run)"]
    for area, data in areas.items():
        lines += ["", f"## {area}"]
        for step, entry in data.items():
            lines += ["", f"### {step}: {entry.get('status', 'running or killed')}", ""]
            skip = ("rows", "status", "rc", "seconds", "budget_s")
            facts = {k: v for k, v in entry.items() if k not in skip and v not in (None, "", [])}
            lines += [f"- {k}: {'; '.join(map(str, v)) if isinstance(v, list) else _cell(v)}" for k, v in facts.items()]
            if entry.get("rows"):
                lines += ([""] if facts else []) + _table(entry["rows"])
    return "\n".join(lines) + "\n"


def _parent_and_group(pid: int) -> tuple[int, int]:
    """A process's parent pid and process group, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2])


def _marked(token: str) -> list[int]:
    """Pids whose environment carries GPU_CHECK_RUN=token, other than this process, its parents and
    their process groups (the script itself and its `tee`s): a step's leftover server or benchmark."""
    mine, groups, pid = set(), set(), os.getpid()
    while pid > 1:
        mine.add(pid)
        try:
            pid, group = _parent_and_group(pid)
        except (OSError, IndexError, ValueError):
            break
        groups.add(group)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in mine:
            continue
        try:
            marked = f"GPU_CHECK_RUN={token}".encode() in (proc / "environ").read_bytes().split(b"\0")
            if marked and _parent_and_group(int(proc.name))[1] not in groups:
                found.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def leftovers(rows_path: Path, step: str, token: str) -> bool:
    """Rows saying what is left on the GPU and which processes of this run still live; True if none."""
    rows: list[dict[str, Any]] = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"]
        apps = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        found = "; ".join(apps[1:]) or "none"
        rows.append({"check": "nvidia-smi compute apps", "found": found, "clean": len(apps) <= 1})
    else:
        rows.append({"check": "nvidia-smi compute apps", "found": "no nvidia-smi here", "clean": True})
    pids = _marked(token) if token else []
    rows.append({"check": "processes of this run", "found": " ".join(map(str, pids)) or "none", "clean": not pids})
    update_area(rows_path, step, rows=rows)
    return all(r["clean"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["status", "summary", "leftovers"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--area", default="system")
    p.add_argument("--step", default="")
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--started", type=float, default=0.0, help="the step's start, Unix seconds")
    p.add_argument("--budget", type=float, default=0.0)
    p.add_argument("--rows", type=Path, default=None, help="leftovers: the area JSON (default OUT/system.json)")
    p.add_argument("--skipped", default="")
    args = p.parse_args()
    if args.action == "status":
        record_status(args.out, args.area, args.step, args.rc, args.started, args.budget, args.skipped)
    elif args.action == "leftovers":
        rows = args.rows or args.out / "system.json"
        clean = leftovers(rows, args.step or "leftovers", os.environ.get("GPU_CHECK_RUN", ""))
        print("no process of this run is left" if clean else "processes of this run are left: see system.json")
        raise SystemExit(0 if clean else 1)
    (args.out / "summary.md").write_text(build_summary(args.out))


if __name__ == "__main__":
    main()
