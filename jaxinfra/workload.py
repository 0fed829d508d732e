"""A serving workload's request lengths (`jaxinfra plan-serve --requests` / `--prompt-len --output-len`):
P50 and P99 of prompt and output tokens, from given percentiles or from a JSONL log of real requests."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class Workload:
    """Request lengths in tokens: P50 and P99 of prompt and output, and the longest request seen."""

    prompt_p50: int
    prompt_p99: int
    output_p50: int
    output_p99: int
    longest: int  # prompt + output of the longest request (from percentiles: P99 + P99)

    @classmethod
    def from_percentiles(cls, prompt: tuple[int, int], output: tuple[int, int]) -> Workload:
        for field, (p50, p99) in (("--prompt-len", prompt), ("--output-len", output)):
            if not 0 < p50 <= p99:
                raise ValueError(f"{field} wants P50,P99 with 0 < P50 <= P99, got {p50},{p99}")
        return cls(prompt[0], prompt[1], output[0], output[1], prompt[1] + output[1])

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Workload:
        """One request per line: `prompt_tokens` and `completion_tokens`, at the top level or under
        `usage` (OpenAI responses as logged)."""
        prompts: list[int] = []
        outputs: list[int] = []
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt, output = _tokens(row, "prompt_tokens"), _tokens(row, "completion_tokens")
            if prompt is None or output is None:
                raise ValueError(f"{path}:{number}: wants integer prompt_tokens and completion_tokens")
            prompts.append(prompt)
            outputs.append(output)
        if not prompts:
            raise ValueError(f"{path}: no requests")
        totals = [p + o for p, o in zip(prompts, outputs, strict=True)]
        return cls(
            percentile(prompts, 50),
            percentile(prompts, 99),
            percentile(outputs, 50),
            percentile(outputs, 99),
            max(totals),
        )


def _tokens(row: Any, key: str) -> int | None:
    """A token count of a logged request, at the top level or under `usage`; None if absent or bad."""
    usage = row.get("usage", row) if isinstance(row, dict) else None
    n = usage.get(key) if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile: the smallest value with at least q% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)), 1) - 1]
