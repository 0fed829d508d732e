"""Documents from text files (blank-line separated), JSONL and Parquet, and a deterministic held-out split."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

FORMATS = ("auto", "text", "jsonl", "parquet")
_SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix.lower() not in _SUFFIXES:
        raise ValueError(f"data.format: cannot tell the format of {path} from its suffix; set text, jsonl or parquet")
    return _SUFFIXES[path.suffix.lower()]


def _read(path: Path, fmt: str, text_field: str, separator: str) -> list[str]:
    if fmt == "text":
        return [d.strip() for d in path.read_text(encoding="utf-8").split(separator) if d.strip()]
    if fmt == "jsonl":
        docs = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(f"{path}:{n}: data.text_field {text_field!r} is not a string field of this record")
            docs.append(record[text_field])
        return docs
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    if text_field not in table.column_names:
        raise ValueError(f"{path}: data.text_field {text_field!r} is not a column ({table.column_names})")
    return [d for d in table.column(text_field).to_pylist() if d]


def load_documents(
    paths: Sequence[str | Path], fmt: str = "auto", text_field: str = "text", separator: str = "\n\n"
) -> list[str]:
    """All documents of `paths` in order (each path a file or a directory of files, sorted)."""
    if fmt not in FORMATS:
        raise ValueError(f"data.format must be one of {FORMATS}, got {fmt!r}")
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in _SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"data.paths: {p} does not exist")
    if not files:
        raise ValueError(f"data.paths: no data files in {list(map(str, paths))}")
    docs = [d for f in files for d in _read(f, _format_of(f, fmt), text_field, separator)]
    if not docs:
        raise ValueError(f"data.paths: {list(map(str, paths))} hold no documents")
    return docs


def split_documents(docs: Sequence[str], valid_fraction: float) -> tuple[list[str], list[str]]:
    """(train, valid): every k-th document (k = 1/valid_fraction) is held out, spread over the corpus."""
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"data.valid_fraction must be in [0, 1), got {valid_fraction}")
    if valid_fraction == 0:
        return list(docs), []
    k = max(2, round(1 / valid_fraction))
    return [d for i, d in enumerate(docs) if i % k != k - 1], [d for i, d in enumerate(docs) if i % k == k - 1]
