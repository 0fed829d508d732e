"""Fetch the King James Bible (public domain) from Debian's archive and write it as plain text, one
chapter per document (documents separated by a blank line).

Uses only `apt-get download` (no root) and `dpkg-deb`: the packages bible-kjv-text (the compressed text)
and bible-kjv (the `bible` reader that decompresses it). Output: <out>/kjv.txt, ~4.3 MB."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "kjv"
_VERSE = re.compile(r"^\s+\d+ (.*)$")


def chapters(raw: str) -> list[str]:
    """`bible` output -> ["Genesis 1\\nIn the beginning ...\\nAnd the earth ...", ...] (verse numbers dropped)."""
    docs: list[list[str]] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        verse = _VERSE.match(line)
        if verse:
            docs[-1].append(verse.group(1).strip())
        else:
            docs.append([line.strip()])
    return ["\n".join(d) for d in docs if len(d) > 1]


def fetch(out: Path = DEFAULT_OUT) -> Path:
    """Download, unpack and convert (skipped when <out>/kjv.txt exists)."""
    target = out / "kjv.txt"
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["apt-get", "download", "bible-kjv-text", "bible-kjv"], cwd=tmp, check=True, capture_output=True)
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/root"], check=True)
        raw = subprocess.run(
            [f"{tmp}/root/usr/bin/bible", "-p", f"{tmp}/root/usr/lib", "-l100000", "Gen1:1-Rev22:21"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    docs = chapters(raw)
    if len(docs) != 1189:
        raise RuntimeError(f"expected the 1189 chapters of the KJV, parsed {len(docs)}")
    out.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_suffix(f".{os.getpid()}.tmp")  # concurrent fetches (test workers) never mix
    tmp_target.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    tmp_target.rename(target)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    print(fetch(parser.parse_args().out))
