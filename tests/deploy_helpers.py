"""What configs/deploy's queries may name: the series our /metrics exports (from serve.http.metrics' own
registry) and the metric names a PromQL expression uses."""

import re

from serve.http.metrics import ServerMetrics

SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",), "gauge": ("",)}
PROMQL_WORDS = {"and", "or", "unless", "offset", "bool", "by", "without", "on", "ignoring", "group_left", "group_right"}


def exported_series(prefix: str = "jaxinfra") -> set[str]:
    """Every series name GET /metrics can show under `prefix`, from the server's registry."""
    names = set()
    for family in ServerMetrics("m", prefix=prefix).registry.collect():
        names.update(family.name + s for s in SUFFIXES[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """Identifiers of a PromQL expression that are neither functions nor keywords nor labels."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)  # label matchers, ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[m.end() :].lstrip().startswith("(") or m.group() in PROMQL_WORDS:
            continue
        if m.start() and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the exponent or unit of a number
        names.add(m.group())
    return names
