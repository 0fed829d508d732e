"""`jaxinfra serve` / `python -m serve`: parse the arguments, start the engine, run uvicorn.

jaxinfra serve --model <dir or preset> [--port 8000] [--api-key KEY] [--max-queue N] ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxinfra.loading import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from serve.async_engine import AsyncEngine
from serve.http.app import build_app
from serve.http.cli_args import build_parser, engine_args_from


def main(argv: Sequence[str] | None = None) -> int:
    import uvicorn

    args = build_parser().parse_args(argv)
    try:
        engine_args = engine_args_from(args)
        engine = AsyncEngine(engine_args, warmup=not args.no_warmup, restart_on_failure=args.restart_engine)
    except (ValueError, RuntimeError) as e:
        print(f"jaxinfra serve: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (DEFAULT_MODEL_NAME if engine_args.model == DEFAULT_MODEL else engine_args.model)
    app = build_app(
        engine, model_name=name, api_key=args.api_key, max_queue=args.max_queue, request_timeout=args.request_timeout
    )
    base = f"http://{args.host}:{args.port}"
    auth = f' -H "Authorization: Bearer {args.api_key}"' if args.api_key else ""
    print(
        f"serving {name} on {base}\n  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}\'\n'
        f'  python -c "from openai import OpenAI; '
        f"c = OpenAI(base_url='{base}/v1', api_key='{args.api_key or 'none'}'); "
        f"print(c.completions.create(model='{name}', prompt='Hello', max_tokens=16).choices[0].text)\"",
        flush=True,
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
    return 0
