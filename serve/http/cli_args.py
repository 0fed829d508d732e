"""`jaxinfra serve` / `python -m serve` arguments: the server's own, one flag per EngineArgs field
with vLLM's name (generated from the dataclass, so a new field is a new flag), and key=value overrides.

Engine arguments come from --config YAML, then flags, then key=value overrides (one loader for all).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing

import yaml

from jaxinfra.sizes import parse_size
from jaxinfra.yaml_config import load_config
from serve.config import EngineArgs
from serve.engine.async_engine import DEFAULT_RESTART_ATTEMPTS
from serve.engine.core_client import DEFAULT_HEARTBEAT_TIMEOUT_S
from serve.http.lora_modules import LoRAModulePath, parse_lora_module
from serve.http.tool_parsers import TOOL_PARSERS
from serve.scale.autoscale_args import add_autoscale_args

ALIASES = {"quantization": ("-q",), "tensor_parallel_size": ("-tp",)}  # short forms vLLM also takes
SIZE_FIELDS = frozenset({"kv_cache_memory"})  # byte counts: 1073741824, 1GiB or 800MB


def flag(field: str) -> str:
    """vLLM's flag for an EngineArgs field: max_num_seqs -> --max-num-seqs."""
    return "--" + field.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal after its line), as vLLM's get_attr_docs."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for stmt, nxt in zip(body.body, body.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (vLLM's names); unset flags are absent from the namespace."""
    group = p.add_argument_group("engine arguments (EngineArgs; default: --config, then these defaults)")
    hints, docs = typing.get_type_hints(EngineArgs), field_docs(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        shown = "" if default is None else f" (default: {default!r})"  # None's meaning is in the docstring
        help_ = f"{docs.get(f.name, '')}{shown}".strip().replace("%", "%%")
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        names = (flag(f.name), *ALIASES.get(f.name, ()))
        if hint is bool:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
        elif typing.get_origin(hint) is typing.Literal:
            choices = typing.get_args(hint)
            group.add_argument(*names, type=type(choices[0]), choices=choices, default=argparse.SUPPRESS, help=help_)
        else:  # int, float, str; anything else is read as YAML
            kind = parse_size if f.name in SIZE_FIELDS else hint if hint in (int, float, str) else yaml.safe_load
            group.add_argument(*names, type=kind, default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_)


def lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules entry (argparse reports a bad one under the flag's name)."""
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxinfra serve", description="OpenAI-compatible server", allow_abbrev=False)
    p.add_argument("--config", help="engine arguments from a YAML file (configs/serve/*.yaml)")
    p.add_argument(
        "overrides", nargs="*", help="engine arguments as key=value, after --config and flags, e.g. max_num_seqs=8"
    )
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key ('Authorization: Bearer KEY' or 'x-api-key: KEY') on every route but "
        "/health, /metrics, /version, /ping",
    )
    p.add_argument(
        "--role",
        choices=("both", "prefill", "decode", "proxy"),
        default="both",
        help="both: one engine serving whole requests; prefill/decode: an engine that offers its prompts' KV "
        "blocks / pulls them (kv_transfer_config's shared-memory connector); proxy: one endpoint over --prefill "
        "and --decode engines",
    )
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="with --role proxy (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="with --role proxy (repeatable)")
    p.add_argument(
        "--prefill-timeout", type=float, default=30.0, help="with --role proxy: seconds before a prefill is a 503"
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="YAML of tenants (requests/min, tokens/min, max concurrent, priority, prefix-cache group) and "
        "their keys (see serve/http/tenants.py); beside --api-key",
    )
    p.add_argument("--protect-metrics", action="store_true", help="/metrics needs the key too")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds for in-flight requests to finish (new ones get 503) before exiting",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="sequences allowed to wait beyond max-num-seqs; requests past that get 429",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is cut off")
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help='how tool_choice "auto" reads calls in the output: hermes (Qwen2.5/Qwen3) or llama3_json (Llama 3.x)',
    )
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='serve tool_choice "auto" (needs --tool-call-parser)'
    )
    p.add_argument(
        "--metrics-prefix",
        default="jaxinfra",
        help="the metric names' prefix on /metrics: 'vllm' gives vLLM's names, for its dashboards and alerts",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        type=lora_module,
        metavar="NAME=PATH",
        help="with --enable-lora: adapters served by name from the start, as name=path or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request\'s "model" picks one (put key=value '
        "overrides before this flag)",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip compiling all batch shapes at start")
    p.add_argument("--ray", action="store_true", help="serve --replicas engines on Ray Serve with prefix-aware routing")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas")
    p.add_argument(
        "--ray-address", default=None, help="with --ray: the cluster to join (default: $RAY_ADDRESS, else a local one)"
    )
    p.add_argument(
        "--ray-gpus-per-replica",
        type=float,
        default=0.0,
        help="with --ray: GPUs each replica reserves (a fraction lets small models share a card)",
    )
    p.add_argument(
        "--restart-engine",
        action="store_true",
        help="start a new engine core if it dies or stops answering (in-flight requests still fail)",
    )
    p.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="seconds without a heartbeat from the engine core before it counts as stuck: killed, its "
        "requests failed, /health 503 (restarted with --restart-engine)",
    )
    p.add_argument(
        "--engine-restart-attempts",
        type=int,
        default=DEFAULT_RESTART_ATTEMPTS,
        help="failed core starts in a row (with back-off) before the server exits non-zero",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="bodies past this are answered 413 before they are parsed "
        "(default: room for a prompt of max-model-len tokens, 64 bytes each, + 256 KiB)",
    )
    add_autoscale_args(p)
    add_engine_flags(p)
    return p


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from --config, the engine flags given and the key=value overrides; a bad value is a
    ValueError naming its flag."""
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    try:
        return load_config(EngineArgs, args.config, flags, args.overrides, kind="engine argument")
    except ValueError as e:
        raise ValueError(name_flag(str(e))) from None


def name_flag(message: str) -> str:
    """'EngineArgs.kv_cache_dtype must be ...' -> 'argument --kv-cache-dtype must be ...'."""
    return re.sub(r"EngineArgs\.(\w+)", lambda m: f"argument {flag(m.group(1))}", message)
