"""`jaxinfra serve` / `python -m serve`: parse the arguments, start the engine, run uvicorn.

jaxinfra serve --model <dir or preset> [--port 8000] [--api-key KEY] [--max-queue N] ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxinfra.loading import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from serve.config import with_role
from serve.engine.async_engine import AsyncEngine
from serve.http.app import build_app
from serve.http.cli_args import build_parser, engine_args_from, name_flag
from serve.http.draining_server import serve_draining
from serve.http.metrics import ServerMetrics
from serve.http.tenants import load_keys_file
from serve.http.tool_parsers import ToolConfig
from serve.scale.autoscale_args import pool_config_from


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    if args.role == "proxy" or args.prefill or args.decode:
        from serve.scale.disagg_proxy import run_proxy

        try:
            if args.role != "proxy":
                raise ValueError("--prefill and --decode go with --role proxy")
            return run_proxy(args.prefill, args.decode, args.host, args.port, args.prefill_timeout)
        except ValueError as e:
            print(f"jaxinfra serve: error: {e}", file=sys.stderr)
            return 2
    try:
        ServerMetrics.check_prefix(args.metrics_prefix)
        api_keys = load_keys_file(args.api_keys_file) if args.api_keys_file else None
        engine_args = with_role(engine_args_from(args), args.role)
        tools = ToolConfig(args.tool_call_parser, args.enable_auto_tool_choice)
        if args.replicas < 1 or (args.replicas > 1 and not args.ray):
            raise ValueError(f"--replicas must be 1, or at least 1 with --ray, got {args.replicas}")
        pool = pool_config_from(args)
        if args.lora_modules and not engine_args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        engine = (
            None
            if args.ray
            else AsyncEngine(
                engine_args,
                warmup=not args.no_warmup,
                restart_on_failure=args.restart_engine,
                heartbeat_timeout=args.engine_heartbeat_timeout,
                restart_attempts=args.engine_restart_attempts,
            )
        )
    except (ValueError, RuntimeError) as e:
        print(f"jaxinfra serve: error: {name_flag(str(e))}", file=sys.stderr)
        return 2
    name = args.served_model_name or (DEFAULT_MODEL_NAME if engine_args.model == DEFAULT_MODEL else engine_args.model)
    server_kwargs = dict(
        model_name=name,
        api_key=args.api_key,
        api_keys=api_keys,
        protect_metrics=args.protect_metrics,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        lora_modules=args.lora_modules,
    )
    if engine is None:
        from serve.scale.ray_app import ReplicaSpec, run

        spec = ReplicaSpec(
            engine_args,
            server_kwargs,
            args.metrics_prefix,
            tools,
            warmup=not args.no_warmup,
            cpus=0.5,
            gpus=args.ray_gpus_per_replica,
        )
        run(spec, args.replicas, pool, host=args.host, port=args.port, address=args.ray_address)
        return 0
    app = build_app(engine, **server_kwargs, metrics=ServerMetrics(name, prefix=args.metrics_prefix))
    app.state.server.tools = tools
    base = f"http://{args.host}:{args.port}"
    keyed = args.api_key or api_keys
    auth = ' -H "Authorization: Bearer $KEY"' if keyed else ""  # keys are never printed
    print(
        f"serving {name} on {base}\n  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}\'\n'
        f'  python -c "from openai import OpenAI; '
        f"c = OpenAI(base_url='{base}/v1', api_key='{'$KEY' if keyed else 'none'}'); "
        f"print(c.completions.create(model='{name}', prompt='Hello', max_tokens=16).choices[0].text)\"",
        flush=True,
    )
    engine.on_fatal = lambda _: app.state.server.drain.begin()  # the core cannot come back: exit non-zero
    try:
        serve_draining(app, args.host, args.port, args.drain_timeout)
    finally:
        engine.shutdown()
    return 1 if engine.fatal else 0
