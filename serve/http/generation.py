"""One generating API call: its engine requests (one per prompt), how they map to choices, what has
been streamed of each, and the prompt-length check that sizes each request's max_tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from serve.engine.core_client import EngineDeadError
from serve.http.errors import bad_request, dead
from serve.http.openai_protocol import ChatCompletionRequest, OpenAIError, _Common
from serve.http.state import ServerState
from serve.http.tenants import Admission, Tenant
from serve.sampling_params import OutputKind, SamplingParams
from serve.types import RequestOutput


def max_tokens_for(limit: int, prompt_len: int, requested: int | None, param: str) -> int:
    """The completion budget of a prompt within max_model_len `limit` (a 400 if it does not fit);
    `param` names the prompt's field in the error."""
    if prompt_len >= limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{prompt_len} tokens, leaving no room for a completion.",
            param=param,
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    return requested


def lenient(params: SamplingParams) -> SamplingParams:
    """`params` with a JSON schema that did not choose its reading given the lenient one."""
    so = params.structured_outputs
    if so is None or so.additional_properties is not None:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, additional_properties=True))


async def merge(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several request streams, tagging each output with its stream's index."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # surfaced to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let each pump leave its stream first
        for s in streams:
            await s.aclose()


async def collect(gen: Generation, merged: AsyncGenerator[tuple[int, RequestOutput], None]) -> None:
    """Record every output of a call that is answered whole (its requests abort if this is cancelled)."""
    try:
        async for i, out in merged:
            gen.record(i, out)
    finally:
        await merged.aclose()


class Generation:
    """One API call: its engine requests (one per prompt), how they map to choices, and what has
    been streamed of each choice."""

    def __init__(
        self,
        state: ServerState,
        req: _Common,
        prompts: list[list[int]],
        logprobs: int | None,
        requested_max: int | None,
        *,
        echo: list[str] | None = None,
    ) -> None:
        """`echo`: the prompts' text, put before each choice's output (completions' echo)."""
        self.state, self.req, self.prompts, self.echo = state, req, prompts, echo
        self.echo_only = echo is not None and requested_max == 0  # max_tokens 0: the prompt alone
        chat = isinstance(req, ChatCompletionRequest)
        self.lora = state.resolve_model(req.model)  # the adapter the call runs with (None: the base model)
        self.model_name = self.lora.lora_name if self.lora is not None else state.model_name
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.ids = [f"{self.id}-{i}" for i in range(len(prompts))]
        kind: OutputKind = "delta" if req.stream else "final_only"
        at_least_one = None if requested_max is None else max(requested_max, 1)
        limit, param = state.engine.max_model_len, "messages" if chat else "prompt"
        try:
            self.params = [
                req.sampling_params(max_tokens_for(limit, len(p), at_least_one, param), logprobs, kind) for p in prompts
            ]
        except (ValueError, TypeError) as e:
            raise bad_request(e) from e
        if self.lora is not None and req.use_beam_search:
            raise OpenAIError(400, "use_beam_search with a LoRA adapter is not supported", param="model")
        if state.engine.args.lenient_json_schemas():  # the server's default for schemas whose request left it
            self.params = [lenient(p) for p in self.params]
        if echo is not None and logprobs is not None:  # echoed tokens carry their logprobs too
            k = max(logprobs, req.prompt_logprobs or 0)
            self.params = [dataclasses.replace(p, prompt_logprobs=k) for p in self.params]
        self.num_seqs = len(prompts) * max(req.n, req.best_of or 1)  # best_of > n only for beam search
        self.completion_tokens = 0
        self.final: dict[int, RequestOutput] = {}
        self.text_offset: dict[int, int] = {}
        self.started: set[int] = set()  # choices that have shown their first output
        self.tenant: Tenant | None = None  # who sent it (with --api-keys-file): its cache salt and priority
        self.admission: Admission | None = None  # its tenant's quota accounting

    def engine_request_options(self) -> dict[str, Any]:
        """cache_salt, priority, kv_transfer_params and the fair policy's tenant and weight for the
        engine: the tenant's cache group salts every request, and its priority adds to the request's
        under the priority policy."""
        req, tenant = self.req, self.tenant
        kv = {"kv_transfer_params": req.kv_transfer_params}
        if tenant is None:
            return {"cache_salt": req.cache_salt, "priority": req.priority, **kv}
        boost = tenant.priority if self.state.engine.args.scheduling_policy == "priority" else 0
        share = {"tenant": tenant.name, "weight": tenant.weight}
        return {"cache_salt": tenant.cache_salt(req.cache_salt), "priority": req.priority + boost, **kv, **share}

    async def start(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        streams: list[AsyncGenerator[RequestOutput, None]] = []
        options, tenant = self.engine_request_options(), self.tenant.name if self.tenant else ""
        try:
            for rid, prompt, params in zip(self.ids, self.prompts, self.params):
                self.state.metrics.start_request(rid, len(prompt), params, tenant)
                stream = await self.state.engine.add_request(rid, prompt, params, lora_request=self.lora, **options)
                streams.append(stream)
        except BaseException as e:
            for s in streams:
                await s.aclose()
            if isinstance(e, EngineDeadError):
                raise dead(e) from e
            if isinstance(e, (ValueError, TypeError)):
                raise bad_request(e) from e
            raise
        return merge(streams)

    def choice(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.req.n + seq_index

    def record(self, i: int, out: RequestOutput) -> None:
        """Count an output's tokens (new ones in a stream; all, once, otherwise) and keep the last."""
        if self.echo_only:  # the one token generated to get there is not part of the answer
            for o in out.outputs:
                o.text, o.token_ids, o.logprobs = "", [], ([] if o.logprobs is not None else None)
        self.completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        if out.finished:
            self.final[i] = out

    def kv_transfer_params(self) -> dict[str, Any]:
        """The response's kv_transfer_params, when the engine offers the prompt's KV (a prefill engine)."""
        params = next((out.kv_transfer_params for out in self.final.values() if out.kv_transfer_params), None)
        return {} if params is None else {"kv_transfer_params": params}

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }
