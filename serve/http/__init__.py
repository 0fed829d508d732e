"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over the AsyncEngine, laid out as vLLM's:

    app.py                   build_app: error handlers, middleware, each serving class's routes
    errors.py                OpenAI error JSON for every failure
    middleware.py            HTTP middleware (API-key auth)
    state.py                 what the endpoints share (engine, metrics, admission count)
    generation.py            one generating call: its engine requests, choices, prompt-length check
    serving_base.py          the serving classes' base: model check, admission, timeout, SSE, envelope
    serving_completion.py    /v1/completions
    serving_chat.py          /v1/chat/completions
    serving_models.py        /health, /metrics, /v1/models, /version
    serving_tokenization.py  /tokenize, /detokenize, /tokenizer_info
    cli_args.py              `jaxinfra serve` arguments
    main.py                  main(): parse, start the engine, run uvicorn

This process tokenizes, detokenizes and streams; the engine core (scheduler, KV cache, model) runs
in a process of its own. Bad input is a 4xx for that request alone; a dead core is a 503 for new
requests and an error event on every open stream.
"""
