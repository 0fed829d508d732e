"""What the GPU machine's Python lacks for our steps, and how to bring it as wheels (gpu_check.sh's preflight).

    python -m benchmarks.gpu_preflight --rows system.json --missing missing.txt   # on the device
    python -m benchmarks.gpu_preflight --download-command benchmarks/wheels     # the command to prepare them here

The device image has jax with the CUDA plugin, flax, optax, orbax, numpy, httpx, ... but not the
serving and data packages below; nothing can be downloaded there. `make gpu-wheels` downloads the
versions our lock pins (requirements/py311-dev.txt) as Python 3.12 manylinux wheels into the
gitignored benchmarks/wheels/, which a device call carries and gpu_check.sh installs offline.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import re
import shlex
from pathlib import Path

from benchmarks.budget import Recorder, add_budget_args

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements/py311-dev.txt"
# (import name, distribution): what serving, training and data need beyond the image, with the
# dependencies of those the image lacks too (wheels are downloaded without dependency resolution).
NEEDED = [
    ("grain", "grain"),
    ("array_record", "array-record"),
    ("portpicker", "portpicker"),
    ("fastapi", "fastapi"),
    ("starlette", "starlette"),
    ("pydantic", "pydantic"),
    ("pydantic_core", "pydantic-core"),
    ("typing_inspection", "typing-inspection"),
    ("annotated_types", "annotated-types"),
    ("opentelemetry", "opentelemetry-api"),
    ("importlib_metadata", "importlib-metadata"),
    ("uvicorn", "uvicorn"),
    ("msgspec", "msgspec"),
    ("llguidance", "llguidance"),
    ("tensorboardX", "tensorboardx"),
    ("typing_extensions", "typing-extensions"),
]


def pins(lock: Path = LOCK) -> dict[str, str]:
    """Each needed distribution's version in our lock."""
    text = lock.read_text().lower()
    out = {}
    for _, dist in NEEDED:
        m = re.search(rf"^{re.escape(dist)}==(\S+)", text, re.M)
        if m:
            out[dist] = m.group(1)
    return out


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def status(dist: str, module: str, want: str | None) -> str:
    """'ok', 'missing' or 'old (X < Y)': installed and at least the locked version's major.minor."""
    if importlib.util.find_spec(module) is None:
        return "missing"
    try:
        have = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "ok"
    if want and _version_tuple(have)[:2] < _version_tuple(want)[:2]:
        return f"old ({have} < {want})"
    return "ok"


def download_command(folder: str) -> str:
    """The pip command that fetches the pinned wheels for the device's Python 3.12 into `folder`."""
    spec = " ".join(f"{d}=={v}" for d, v in pins().items())
    tags = (
        "manylinux2014",
        *(f"manylinux_2_{n}" for n in (17, 24, 26, 27, 28, 31, 34, 35, 39)),
    )  # the image: glibc 2.39
    platforms = " ".join(f"--platform {t}_x86_64" for t in tags)
    return (
        f"python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
        f"{platforms} -d {shlex.quote(folder)} {spec}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--missing", type=Path, default=None, help="file to list the missing distributions in")
    p.add_argument("--download-command", metavar="DIR", default=None, help="print the pip download command")
    add_budget_args(p, "preflight")
    args = p.parse_args()
    if args.download_command:
        print(download_command(args.download_command))
        return
    rec = Recorder.from_args(args)
    rec.note(python=platform.python_version())
    if args.rows is not None:  # a recorded run says which jax and devices it ran on
        import jax

        rec.note(jax=jax.__version__, devices=[str(d) for d in jax.devices()])
    locked = pins()
    missing = []
    for module, dist in NEEDED:
        state = status(dist, module, locked.get(dist))
        rec.add({"package": dist, "state": state, "locked": locked.get(dist)})
        if state != "ok":
            missing.append(dist)
    if args.missing:
        args.missing.write_text("".join(f"{d}\n" for d in missing))
    if missing:
        print(f"missing or too old here: {' '.join(missing)}")
        print("steps that need them are skipped. To bring them: here (with internet), `make gpu-wheels`, i.e.")
        print(f"  {download_command('benchmarks/wheels')}")
        print("then carry benchmarks/wheels in the device call; gpu_check.sh installs them offline.")
        rec.note(missing=missing, wheels_hint="make gpu-wheels; carry benchmarks/wheels")
    else:
        print("every needed package is installed")
    print(json.dumps({"python": platform.python_version(), "missing": missing}))


if __name__ == "__main__":
    main()
