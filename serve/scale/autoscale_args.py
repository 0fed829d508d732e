"""`jaxinfra serve --ray` autoscaling settings (`PoolConfig`) and their flags, one per field of
`AutoscaleConfig` and `PoolConfig`, named like Ray Serve's autoscaling_config (--min-replicas,
--max-replicas, --upscale-delay-s, --downscale-delay-s, --metrics-interval-s, --look-back-period-s)
with the SLO targets beside them. Without --min/--max-replicas the count stays at --replicas."""

from __future__ import annotations

import argparse
import dataclasses

from serve.scale.autoscale import AutoscaleConfig

HELP = {
    "min_replicas": "fewest engine replicas autoscaling keeps (default: --replicas)",
    "max_replicas": "most engine replicas autoscaling starts (default: --replicas)",
    "ttft_p95_target_s": "SLO: P95 time to first token (s) above which replicas are added",
    "itl_p95_target_s": "SLO: P95 inter-token latency (s) above which replicas are added",
    "waiting_per_replica_target": "SLO: requests waiting per replica above which replicas are added",
    "kv_usage_target": "SLO: KV-cache usage (0-1, counted while requests wait) above which replicas are added",
    "downscale_fraction": "a replica is removed when every signal stays below this fraction of its target",
    "upscale_delay_s": "seconds the SLO must be missed at every poll before scaling up",
    "downscale_delay_s": "seconds every signal must be quiet before scaling down by one",
    "metrics_interval_s": "seconds between polls of the replicas' metrics",
    "look_back_period_s": "seconds of requests each poll's P95s cover",
}


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The SLO policy plus how often to poll (`metrics_interval_s`), how far back the P95s look
    (`look_back_period_s`), and how long a removed replica may finish its requests."""

    autoscale: AutoscaleConfig
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0
    drain_timeout_s: float = 30.0
    poll_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("metrics_interval_s", "look_back_period_s", "drain_timeout_s", "poll_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PoolConfig.{name} must be > 0, got {getattr(self, name)!r}")


POOL_FIELDS = ("metrics_interval_s", "look_back_period_s")


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_autoscale_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("autoscaling (with --ray)")
    defaults = {f.name: f.default for f in dataclasses.fields(AutoscaleConfig)} | {
        f.name: f.default for f in dataclasses.fields(PoolConfig) if f.name in POOL_FIELDS
    }
    for name, help_text in HELP.items():
        kind = int if name.endswith("_replicas") else float
        default = None if name.endswith("_replicas") else defaults[name]
        suffix = "" if default is None else f" (default {default})"
        group.add_argument(flag(name), dest=name, type=kind, default=default, help=help_text + suffix)


def pool_config_from(args: argparse.Namespace) -> PoolConfig:
    """The pool's config from the parsed flags (--drain-timeout bounds a removed replica's drain);
    a bad value is a ValueError naming its flag."""
    values = {name: getattr(args, name) for name in HELP}
    if values["min_replicas"] is None:
        values["min_replicas"] = args.replicas
    if values["max_replicas"] is None:
        values["max_replicas"] = max(args.replicas, values["min_replicas"])
    pool = {name: values.pop(name) for name in POOL_FIELDS}
    try:
        return PoolConfig(AutoscaleConfig(**values), drain_timeout_s=args.drain_timeout, **pool)
    except ValueError as e:
        raise ValueError(rename_fields(str(e))) from None


def rename_fields(message: str) -> str:
    """'AutoscaleConfig.min_replicas must ...' -> 'argument --min-replicas must ...'."""
    for name in HELP:
        for owner in ("AutoscaleConfig", "PoolConfig"):
            message = message.replace(f"{owner}.{name}", f"argument {flag(name)}")
    return message
