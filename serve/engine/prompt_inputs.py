"""vLLM's offline prompt forms: a string, a list of token ids, {"prompt": str}, {"prompt_token_ids":
[...]}, or a list of any of them (mixed); each becomes the engine's text or token-id prompt."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

Prompt = str | list[int]  # what the engine takes
PromptLike = str | Sequence[int] | Mapping[str, Any]  # what LLM.generate takes for one prompt

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


@dataclasses.dataclass(frozen=True)
class PromptInput:
    """One prompt for the engine, with vLLM's per-prompt prefix-cache salt."""

    prompt: Prompt
    cache_salt: str | None = None


def parse_prompts(prompts: Any) -> list[PromptInput]:
    """One prompt or a list of prompts, in any of vLLM's forms; a ValueError names the bad field."""
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        return [_parse_one(prompts, "prompts")]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return [_parse_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0 and _is_int(value[0])


def _is_int(value: Any) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, bool)


def _parse_one(p: Any, where: str) -> PromptInput:
    if isinstance(p, str):
        return PromptInput(p)
    if _is_token_ids(p):
        return PromptInput(list(p))
    if not isinstance(p, Mapping):
        raise ValueError(f"{where} must be a string, token ids or a prompt dict, got {type(p).__name__}")
    unknown = sorted(set(p) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not supported (a prompt dict takes {', '.join(PROMPT_KEYS)})")
    salt = p.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{where}.cache_salt must be a string, got {type(salt).__name__}")
    if "prompt_token_ids" in p:  # vLLM's TokensPrompt; its optional "prompt" is only a label
        ids = p["prompt_token_ids"]
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not ids or not all(_is_int(t) for t in ids):
            raise ValueError(f"{where}.prompt_token_ids must be a non-empty list of ints, got {ids!r}")
        return PromptInput(list(ids), salt)
    if "prompt" not in p:
        raise ValueError(f"{where} needs 'prompt' or 'prompt_token_ids'")
    if not isinstance(p["prompt"], str):
        raise ValueError(f"{where}.prompt must be a string, got {type(p['prompt']).__name__}")
    return PromptInput(p["prompt"], salt)
