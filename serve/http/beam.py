"""`use_beam_search` requests on /v1/completions and /v1/chat/completions: each prompt's beam search
runs through the engine (serve/engine/beam_search.py) and its `n` best hypotheses become the choices. The call
is admitted, timed out and aborted on disconnect like any other (serving_base.GenerationServing)."""

from __future__ import annotations

import asyncio

from serve.engine.beam_search import BeamSearchParams, beam_search_async
from serve.http.generation import Generation
from serve.http.state import ServerState


async def beam_search_answer(state: ServerState, gen: Generation) -> None:
    """Run every prompt's beam search and record its hypotheses as gen's outputs; cancelling it aborts
    the beams' engine requests."""
    p = gen.params[0]
    params = BeamSearchParams.from_sampling_params(p)
    options = gen.engine_request_options()
    options.pop("kv_transfer_params")  # a beam's one-token steps never hand their KV to a decode engine
    searches = [
        beam_search_async(state.engine, rid, prompt, params, **options) for rid, prompt in zip(gen.ids, gen.prompts)
    ]
    outs = await asyncio.gather(*searches)
    for i, (rid, out) in enumerate(zip(gen.ids, outs)):
        gen.record(i, out.to_request_output(rid, None, p.n, p.logprobs))
