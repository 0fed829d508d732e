"""Byte sizes as people write them ('5GB', '200MiB') and as they read them: a leaf module that the CLI, plan-serve
and serve's argument parser share without importing one another."""

from __future__ import annotations

import argparse
import re

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '200MiB', '1024' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 5GB, 200MiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def human_size(n: float) -> str:
    """Bytes -> '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError
