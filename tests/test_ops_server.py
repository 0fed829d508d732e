"""Operating one server with tenants: quotas answered with 429 + Retry-After, prefix caches kept
apart per tenant, per-tenant metrics, /status, and /dashboard drawn by headless Chromium.

One server for the module, keys from a keys file: `small` (a tokens/min quota), `big` and `other`
(no limits, separate caches), `wiki` and `docs` (one shared cache group).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from pathlib import Path

import httpx
import pytest

from serve.http.main import main
from serve.http.tenants import load_keys_file
from tests.headless_chromium import chromium_path, open_page
from tests.server_helpers import MODEL_NAME, core_stats, eventually, metric, running_server

pytestmark = pytest.mark.slow  # tens of seconds on 2 cores: make test-fast leaves it out

KEYS = {
    "small": "sk-small-0001",
    "big": "sk-big-000001",
    "other": "sk-other-0001",
    "wiki": "sk-wiki-0001",
    "docs": "sk-docs-0001",
}
KEYS_FILE = """
tenants:
  small: {tokens_per_minute: 60}
  big: {operator: true}  # sees every tenant in /status
  other: {}
  wiki: {prefix_cache_group: kb}
  docs: {prefix_cache_group: kb}
keys:
""" + "".join(f"  {key}: {name}\n" for name, key in KEYS.items())
ARTIFACTS = Path(os.environ.get("JAXINFRA_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(KEYS_FILE)
    with running_server(
        api_keys=load_keys_file(path), max_model_len=256, max_num_seqs=8, num_gpu_blocks_override=160
    ) as (url, app):
        yield url, app


def complete(url: str, tenant: str, prompt: list[int], max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=auth(tenant), timeout=60)


def test_over_quota_tenant_gets_429_with_retry_after_while_another_is_served(server):
    url, _ = server
    first = complete(url, "small", list(range(10, 40)), max_tokens=8)  # 30 + 8 of its 60 tokens a minute
    assert first.status_code == 200
    refused = complete(url, "small", list(range(10, 40)), max_tokens=8)  # 38 + 30 > 60
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "quota_exceeded"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    big_before = metric(url, "jaxinfra:request_success_total", tenant="big")  # other tests in the module use "big"
    assert complete(url, "big", list(range(10, 40)), max_tokens=8).status_code == 200
    assert metric(url, "jaxinfra:request_success_total", tenant="small") == 1
    assert metric(url, "jaxinfra:request_success_total", tenant="big") == big_before + 1
    assert metric(url, "jaxinfra:prompt_tokens_total", tenant="small") == 30


def test_a_tenants_prefix_is_not_a_cache_hit_for_another(server):
    url, app = server
    shared = list(range(100, 164))  # 8 full blocks of 8

    def hits_after(tenant: str) -> int:
        before = core_stats(app).prefix_cache_hits
        assert complete(url, tenant, shared + [7], max_tokens=1).status_code == 200
        return core_stats(app).prefix_cache_hits - before

    assert hits_after("big") == 0  # cold
    assert hits_after("other") == 0  # the same prompt, another tenant: nothing reused
    assert hits_after("big") == 64  # the owner hits its own blocks (so the check above could fail)
    assert hits_after("wiki") == 0
    assert hits_after("docs") == 64  # tenants of one group share


def test_status_reports_load_tenants_and_memory(server):
    url, _ = server
    assert httpx.get(f"{url}/status").status_code == 401
    assert complete(url, "other", list(range(50, 70)), max_tokens=4).status_code == 200
    s = httpx.get(f"{url}/status", headers=auth("big")).json()
    assert s["model"] == MODEL_NAME and s["healthy"] and not s["draining"]
    assert s["total_generation_tokens"] > 0 and s["ttft_s"]["p50"] > 0
    assert s["engine_args"]["max_num_seqs"] == 8
    assert s["tenants"]["small"]["limits"] == {"tokens_per_minute": 60, "priority": 0, "weight": 1.0}
    assert s["tenants"]["other"]["admitted"] >= 1 and s["tenants"]["other"]["in_flight"] == 0
    device = s["memory"]["devices"][0]
    assert device["weights"] > 0 and device["kv_pool"] > 0 and s["memory"]["process_rss"] > device["weights"]


def test_bad_keys_file_is_a_clear_error_at_start(tmp_path, capsys):
    bad = tmp_path / "keys.yaml"
    bad.write_text("tenants: {a: {tokens_per_minute: 0}}\nkeys: {sk-aaaaaaaaaa: a}\n")
    assert main(["--api-keys-file", str(bad), "--model", "tiny-qwen3"]) == 2
    err = capsys.readouterr().err
    assert "--api-keys-file" in err and "tokens_per_minute must be a positive int" in err
    assert "sk-aaaaaaaaaa" not in err


def test_dashboard_draws_in_headless_chromium(server):
    assert chromium_path() is not None, "the dashboard test needs Debian's chromium (.ci/run installs it)"
    url, _ = server
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        load = [pool.submit(complete, url, "big", [i] * 20 + list(range(40)), 100) for i in range(4)]
        with open_page(f"{url}/dashboard", headers=auth("big")) as page:
            page.wait_for("Number(document.body.dataset.updates) >= 2")
            assert page.wait_for("parseFloat(document.getElementById('tokens-out').textContent) > 0")
            assert page.evaluate("document.querySelectorAll('#chart-tokens polyline.series').length") == 2
            for f in load:
                assert f.result().status_code == 200
            page.wait_for("window.lastStatus && window.lastStatus.running === 0 && window.lastStatus.waiting === 0")
            page.wait_for("Number(document.body.dataset.updates) >= 4")
            status = httpx.get(f"{url}/status", headers=auth("big")).json()
            assert page.evaluate("document.getElementById('running').textContent") == str(status["running"])
            assert float(page.evaluate("document.getElementById('tokens-out').textContent")) > 0
            assert page.evaluate("document.querySelectorAll('#tenants tr').length") == 1 + len(KEYS)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(ARTIFACTS / "dashboard.png")
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    if os.environ.get("JAXINFRA_UPDATE_DOCS"):
        shutil.copy(ARTIFACTS / "dashboard.png", Path(__file__).parent.parent / "docs" / "dashboard.png")
    assert eventually(lambda: core_stats(server[1]).num_running == 0)
