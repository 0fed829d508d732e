"""Offline API mirroring vLLM: LLM(model=..., **engine_args).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any, cast

import numpy as np
from tqdm.auto import tqdm

from serve.config import EngineArgs
from serve.core.pooling import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from serve.core.pooling.config import engine_pooling_spec
from serve.core.pooling.scoring import pair_up, score_inputs, scores_from
from serve.core.pooling.vectors import finish_embeddings
from serve.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, step_params
from serve.engine.llm_engine import LLMEngine
from serve.engine.prompt_inputs import Prompt, PromptLike, parse_prompts
from serve.sampling_params import SamplingParams
from serve.types import LoRARequest, RequestOutput


class LLM:
    """Batch generation with the continuous-batching engine."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        named: dict[str, Any] = {"model": model} if model else {}
        args = EngineArgs(**named, **engine_args)
        self.engine = LLMEngine.from_engine_args(args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def update_weights(self, source: Any) -> None:
        """Swap in new weights (a model, an nnx.State, a training state or its params, any sharding:
        placed as the engine's) between generate calls; the prefix cache is dropped. For RL loops
        that alternate rollouts and updates, without a checkpoint round trip."""
        self.engine.core.update_weights(source)

    def generate(
        self,
        prompts: PromptLike | Seq[PromptLike],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: strings, token id lists, {"prompt": ...} or
        {"prompt_token_ids": [...]} dicts (vLLM's forms, optionally with "cache_salt"), or a list of them.
        `lora_request`: the adapter every prompt runs with, or one per prompt (None: the base model)."""
        inputs = parse_prompts(prompts)
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(inputs)
        if len(params) != len(inputs):
            raise ValueError(f"{len(params)} sampling_params for {len(inputs)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Seq) else [lora_request] * len(inputs)
        if len(loras) != len(inputs):
            raise ValueError(f"{len(loras)} lora_requests for {len(inputs)} prompts")
        if any(lora is not None for lora in loras) and any(p is not None and p.use_beam_search for p in params):
            raise ValueError("lora_request with use_beam_search is not supported")
        if any(p is not None and p.use_beam_search for p in params):
            return [self._beam_request(i.prompt, cast(SamplingParams, p)) for i, p in zip(inputs, params)]
        order = []
        try:
            for i, p, lora in zip(inputs, params, loras):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(
                    rid,
                    i.prompt,
                    dataclasses.replace(p or SamplingParams(), output_kind="final_only"),
                    cache_salt=i.cache_salt,
                    lora_request=lora,
                )
                order.append(rid)
        except (ValueError, TypeError):
            for rid in order:  # a later prompt was refused: none of this call's prompts stay queued
                self.engine.abort_request(rid)
            raise
        return self._run(order, use_tqdm)

    def beam_search(self, prompts: PromptLike | Seq[PromptLike], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the best `params.beam_width` hypotheses of each prompt, best first."""
        tok = self.engine.tokenizer
        searches = [
            BeamSearch(self.engine.input_processor.tokenize(i.prompt), params, self.engine.core.eos_token_ids)
            for i in parse_prompts(prompts)
        ]
        while live := [s for s in searches if not s.done]:
            batch = [(s, seq) for s in live for seq in s.pending()]
            outs = self.generate([seq for _, seq in batch], [step_params(s) for s, _ in batch], use_tqdm=False)
            at = 0
            for s in live:
                n = len(s.pending())
                s.advance([(o.outputs[0].logprobs or [{}])[0] for o in outs[at : at + n]])
                at += n
        return [s.output(tok.decode if tok else None) for s in searches]

    def _beam_request(self, prompt: Prompt, p: SamplingParams) -> RequestOutput:
        """A `use_beam_search` request answered as a RequestOutput with its `n` best beams."""
        out = self.beam_search(prompt, BeamSearchParams.from_sampling_params(p))[0]
        return out.to_request_output(
            f"offline-{next(self._ids)}", prompt if isinstance(prompt, str) else None, p.n, p.logprobs
        )

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict) else messages)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this engine has no tokenizer, so no chat template")
        prompts: list[Prompt] = [
            tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _pool(self, prompts: list[list[int]]) -> list[list[float]]:
        """Pooled outputs of token-id prompts from the engine core (LLM(..., runner="pooling"))."""
        return self.engine.core.utility("pool", [prompts])

    def embed(
        self, prompts: PromptLike | Seq[PromptLike], dimensions: int | None = None
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's embedding (pooled as the checkpoint or pooler_config says,
        cut to `dimensions` first when given, then normalized if the pooler normalizes)."""
        args = self.engine.core.args
        spec, _ = engine_pooling_spec(args.model, args.convert, args.pooler_config)
        if spec.task != "embed":
            raise ValueError(f"LLM.embed needs an embedding model; this one is served for {spec.task}")
        ids = [self.engine.input_processor.tokenize(i.prompt) for i in parse_prompts(prompts)]
        vectors = finish_embeddings(np.asarray(self._pool(ids), np.float32), spec.pooler.normalize, dimensions)
        return [
            EmbeddingRequestOutput(f"embed-{next(self._ids)}", p, EmbeddingOutput(v.tolist()))
            for p, v in zip(ids, vectors)
        ]

    def score(self, text_1: str | list[str], text_2: str | list[str]) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: one text_1 against each text_2 (or pairwise), by the cross-encoder head
        of a classify model or the cosine of an embedding model's embeddings."""
        args, tok = self.engine.core.args, self.engine.tokenizer
        if tok is None:
            raise ValueError("LLM.score needs a tokenizer")
        spec, _ = engine_pooling_spec(args.model, args.convert, args.pooler_config)
        inputs = score_inputs(tok, spec.task, pair_up(text_1, text_2))
        scores = scores_from(spec.task, self._pool(inputs))
        return [ScoringRequestOutput(f"score-{next(self._ids)}", p, ScoringOutput(s)) for p, s in zip(inputs, scores)]

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in order]
