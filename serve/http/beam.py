"""`use_beam_search` requests on /v1/completions and /v1/chat/completions: each prompt's beam search
runs through the engine (serve/beam_search.py) and its `n` best hypotheses become the choices."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response

from serve.beam_search import BeamSearchParams, beam_search_async
from serve.core_client import EngineDeadError
from serve.http.errors import bad_request, dead
from serve.http.generation import Generation
from serve.openai_protocol import OpenAIError

if TYPE_CHECKING:
    from serve.http.serving_base import GenerationServing


async def respond_beam_search(serving: GenerationServing, gen: Generation) -> Response:
    """The whole answer of a beam-search call (a 408 past the request timeout)."""
    state, p = serving.state, gen.params[0]
    try:
        params = BeamSearchParams.from_sampling_params(p)
        searches = [beam_search_async(state.engine, rid, prompt, params) for rid, prompt in zip(gen.ids, gen.prompts)]
        outs = await asyncio.wait_for(asyncio.gather(*searches), state.request_timeout)
    except TimeoutError as e:
        raise OpenAIError(408, "request timed out", type_="timeout") from e
    except EngineDeadError as e:
        raise dead(e) from e
    except (ValueError, TypeError) as e:
        raise bad_request(e) from e
    for i, (rid, out) in enumerate(zip(gen.ids, outs)):
        gen.record(i, out.to_request_output(rid, None, p.n))
    return JSONResponse(serving.final(gen, False))
