"""configs/deploy: the Grafana dashboard and the alert rules name only metrics our server exports
(collected from serve.http.metrics' registry); the alert rules pass their promtool unit tests."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy_helpers import exported_series, metric_names

DEPLOY = Path(__file__).resolve().parents[1] / "configs" / "deploy"
VLLM_PANELS = (  # vLLM's Grafana panel set, as titles here
    "E2E request latency",
    "Time to first token",
    "Inter-token latency",
    "Time per output token",
    "Queue time",
    "Prefill and decode time",
    "Token throughput",
    "Scheduler state",
    "KV cache usage",
    "Prefix cache hit rate",
    "Finished requests by reason",
)


def test_metric_name_parser() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(jaxinfra:ttft_bucket{model_name=~"$m"}[$__rate_interval]))) > 1e3'
    )
    assert metric_names(expr) == {"jaxinfra:ttft_bucket"}
    assert metric_names("up{job='x'} == 0 and on (instance) foo") == {"up", "foo"}


def test_exported_names_come_from_the_registry() -> None:
    names = exported_series()
    assert {"jaxinfra:time_to_first_token_seconds_bucket", "jaxinfra:num_requests_waiting"} <= names
    assert {"jaxinfra:kv_cache_usage_perc", "jaxinfra:request_success_total"} <= names


@pytest.mark.parametrize("prefix", ["jaxinfra", "vllm"])  # the dashboard's `prefix` variable
def test_grafana_dashboard_queries_name_exported_metrics(prefix: str) -> None:
    board = json.loads((DEPLOY / "grafana" / "jaxinfra.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert prefix in variables["prefix"]["query"].split(",")
    exported = exported_series(prefix)
    titles = [p["title"] for p in board["panels"]]
    for wanted in VLLM_PANELS:
        assert any(t.startswith(wanted) for t in titles), wanted
    used: set[str] = set()
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    # template variables: label_values(<metric>, <label>)
    exprs += [v["definition"].split("(", 1)[1].split(",")[0] for v in variables.values() if v["type"] == "query"]
    for expr in exprs:
        names = metric_names(expr.replace("${prefix}", prefix))
        assert names, expr
        assert names <= exported, (expr, names - exported)
        used |= names
    for p in board["panels"]:
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    assert len(used) >= 15


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_name_exported_metrics_and_wait_out_noise() -> None:
    exported = exported_series() | {"up"}  # `up`: Prometheus's own scrape health
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {
        "JaxinfraTTFTAboveTarget",
        "JaxinfraKVCacheFullWithQueue",
        "JaxinfraEngineDown",
    }
    for rule in rules:
        assert metric_names(rule["expr"]) <= exported, rule["alert"]
        assert rule["for"] in ("1m", "2m", "5m") and rule["labels"]["severity"], rule["alert"]
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yaml").read_text())["tests"]
    for case in tests:
        for series in case["input_series"]:
            assert series["series"].split("{")[0] in exported, series["series"]


def test_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install Debian's `prometheus` package (.ci/run does)"
    where = DEPLOY / "prometheus"
    for args in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts_test.yaml"]):
        run = subprocess.run([promtool, *args], cwd=where, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    tests = yaml.safe_load((where / "alerts_test.yaml").read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == {r["alert"] for r in alert_rules()}  # every rule has a case where it fires
