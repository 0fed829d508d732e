"""configs/deploy/k8s: built-in kinds validate against Kubernetes' schemas (kubernetes-validate,
strict), the KEDA ScaledObject and ServiceMonitor against their structure, and the pieces agree:
selectors, port names, probes on /health, the drain fitting the grace period, engine arguments
that EngineArgs takes and that fit an H200, a scaling query over exported metrics."""

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxinfra.loading import load_config
from jaxinfra.workload import Workload
from serve.config import EngineArgs
from serve.plan_serve import GPUS, Device, plan
from serve.scale.autoscale import AutoscaleConfig
from tests.deploy_helpers import exported_series, metric_names

K8S = Path(__file__).resolve().parents[1] / "configs" / "deploy" / "k8s"
BUILT_IN = {"ConfigMap", "Deployment", "Service"}


def _object(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_STR, _INT = {"type": "string"}, {"type": "integer", "minimum": 0}
_META = {"type": "object", "required": ["name"], "properties": {"name": _STR}}
_LABELS = {"type": "object", "additionalProperties": _STR}
_HPA_RULES = _object(
    {
        "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {
            "type": "array",
            "minItems": 1,
            "items": _object(
                {
                    "type": {"enum": ["Pods", "Percent"]},
                    "value": {"type": "integer", "minimum": 1},
                    "periodSeconds": _INT,
                },
                ["type", "value", "periodSeconds"],
            ),
        },
    },
    [],
)
SCALED_OBJECT = _object(  # keda.sh/v1alpha1: the fields used here, with their types
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _META,
        "spec": _object(
            {
                "scaleTargetRef": _object({"apiVersion": _STR, "kind": _STR, "name": _STR}, ["name"]),
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "advanced": _object(
                    {
                        "horizontalPodAutoscalerConfig": _object(
                            {"behavior": _object({"scaleUp": _HPA_RULES, "scaleDown": _HPA_RULES}, [])}, []
                        )
                    },
                    [],
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {
                            "type": _STR,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": {"type": "object", "additionalProperties": _STR},  # strings only
                        },
                        ["type", "metadata"],
                    ),
                },
            },
            ["scaleTargetRef", "triggers"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)
SERVICE_MONITOR = _object(  # monitoring.coreos.com/v1
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _META,
        "spec": _object(
            {
                "jobLabel": _STR,
                "selector": _object({"matchLabels": _LABELS}, ["matchLabels"]),
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {"port": _STR, "path": _STR, "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}},
                        ["port"],
                    ),
                },
            },
            ["selector", "endpoints"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)
CRDS = {"ScaledObject": SCALED_OBJECT, "ServiceMonitor": SERVICE_MONITOR}


def manifests() -> dict[str, dict]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


@pytest.mark.parametrize("kind", sorted(BUILT_IN | set(CRDS)))
def test_manifest_validates(kind: str) -> None:
    doc = manifests()[kind]
    if kind in BUILT_IN:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    else:
        jsonschema.validate(doc, CRDS[kind])


def test_validation_catches_mistakes() -> None:
    broken = manifests()["Deployment"]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGets"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    scaled = manifests()["ScaledObject"]
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 0.45  # KEDA wants strings
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, SCALED_OBJECT)


def test_pieces_agree() -> None:
    m = manifests()
    pod = m["Deployment"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    labels = pod["metadata"]["labels"]
    assert m["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = m["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    monitor = m["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert {e["path"] for e in monitor["endpoints"]} == {"/metrics"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the drain fits the grace period: preStop sleep, then SIGTERM and --drain-timeout
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1].split()[-1])
    assert pre_stop + float(args["drain-timeout"]) < pod["spec"]["terminationGracePeriodSeconds"]
    mounts = {v["mountPath"]: v["name"] for v in container["volumeMounts"]}
    assert args["config"].rsplit("/", 1)[0] in mounts
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts[args["config"].rsplit("/", 1)[0]])
    assert volume["configMap"]["name"] == m["ConfigMap"]["metadata"]["name"]
    assert args["config"].rsplit("/", 1)[1] in m["ConfigMap"]["data"]


def test_server_takes_the_deployments_arguments(tmp_path: Path) -> None:
    """`jaxinfra serve`'s own parser and engine-argument loader read the container's command line."""
    from serve.http.cli_args import build_parser, engine_args_from

    m = manifests()
    container = m["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["jaxinfra", "serve"]
    (tmp_path / "engine.yaml").write_text(m["ConfigMap"]["data"]["engine.yaml"])
    argv = [a if not a.startswith("--config=") else f"--config={tmp_path / 'engine.yaml'}" for a in container["args"]]
    args = build_parser().parse_args(argv)
    assert (args.host, args.port, args.drain_timeout) == ("0.0.0.0", 8000, 90.0)
    engine = engine_args_from(args)
    assert engine.model == "/models/llama-3.1-8b" and engine.max_model_len == 16384


def test_engine_config_is_valid_and_fits_an_h200() -> None:
    data = yaml.safe_load(manifests()["ConfigMap"]["data"]["engine.yaml"])
    args = EngineArgs(**data)
    cfg = load_config("llama-3.1-8b")  # the preset of the model the volume holds
    planned = plan(
        "llama-3.1-8b", cfg, args, Device("H200", GPUS["h200"]), Workload.from_percentiles((512, 2048), (256, 1024))
    )
    assert args.max_model_len is not None and args.max_model_len <= planned.max_model_len_limit


def test_scaled_object_scales_the_deployment_on_ttft_p95() -> None:
    m = manifests()
    spec = m["ScaledObject"]["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": m["Deployment"]["metadata"]["name"],
    }
    trigger = spec["triggers"][0]
    query = trigger["metadata"]["query"]
    assert trigger["type"] == "prometheus" and query.startswith("histogram_quantile(0.95,")
    assert metric_names(query) == {"jaxinfra:time_to_first_token_seconds_bucket"} <= exported_series()
    assert "[2m]" in query
    policy = AutoscaleConfig()  # the same SLO and delays as serve/scale/autoscale.py's defaults
    assert float(trigger["metadata"]["threshold"]) == policy.ttft_p95_target_s
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == policy.upscale_delay_s
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == policy.downscale_delay_s
    assert spec["minReplicaCount"] == policy.min_replicas and spec["maxReplicaCount"] == policy.max_replicas
