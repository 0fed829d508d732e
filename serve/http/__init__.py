"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over the AsyncEngine, laid out as vLLM's:

    app.py                   build_app: error handlers, middleware, each serving class's routes
    errors.py                OpenAI error JSON for every failure
    middleware.py            HTTP middleware (MIDDLEWARE; API keys: serve/http/auth.py)
    body_limit.py            --max-request-body-bytes (413 before parsing)
    drain.py                 graceful shutdown on SIGTERM: whether draining, and until when
    draining_server.py       uvicorn whose first SIGTERM drains instead of closing
    state.py                 what the endpoints share (engine, metrics, admission count)
    generation.py            one generating call: its engine requests, choices, prompt-length check
    serving_base.py          the serving classes' base: model check, admission, timeout, SSE, envelope
    serving_completion.py    /v1/completions (beams: beam.py)
    serving_chat.py          /v1/chat/completions (tool calls: tool_calls.py; beams: beam.py)
    serving_responses.py     /v1/responses
    serving_models.py        /health, /ping, /metrics, /v1/models, /version
    serving_tokenization.py  /tokenize, /detokenize, /tokenizer_info
    serving_status.py        /status, /dashboard
    cli_args.py              `jaxinfra serve` arguments (one flag per EngineArgs field, generated)
    main.py                  main(): parse, start the engine, run uvicorn

This process tokenizes, detokenizes and streams; the engine core (scheduler, KV cache, model) runs
in a process of its own. Bad input is a 4xx for that request alone; a dead core is a 503 for new
requests and an error event on every open stream.
"""
