"""Per-request sampling settings, with vLLM's names and meanings, range-checked on construction."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per position (vLLM's default max_logprobs)
MAX_BANNED_STOP_IDS = 32  # stop_token_ids held back on device while min_tokens is not reached
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
OutputKind = Literal["cumulative", "delta", "final_only"]
# StructuredOutputsParams' fields: the types each accepts (checked before anything reads them) and how to say it
STRUCTURED_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "json": ((dict, str, type(None)), "a JSON schema (an object or a string)"),
    "json_object": ((bool,), "a bool"),
    "regex": ((str, type(None)), "a string"),
    "choice": ((list, type(None)), "a list of strings"),
    "grammar": ((str, type(None)), "a string"),
    "additional_properties": ((bool, type(None)), "a bool or null"),
}


@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of a JSON schema (dict or
    string), any JSON object, a regular expression, a choice among strings, or a Lark grammar.

    additional_properties: whether a schema's objects that do not say otherwise may hold keys beyond
    their `properties` (JSON Schema's reading); False (vLLM's default backend's reading) forbids them;
    None: the server's default (False unless started with structured_outputs_config
    {"disable_additional_properties": false})."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    additional_properties: bool | None = None

    def __post_init__(self) -> None:
        for field, (accepted, what) in STRUCTURED_FIELD_TYPES.items():
            value = getattr(self, field)
            if not isinstance(value, accepted):
                got = type(value).__name__
                raise ValueError(f"SamplingParams.structured_outputs.{field} must be {what}, got {got}")
        given = [f for f in ("json", "regex", "choice", "grammar") if getattr(self, f) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"SamplingParams.structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be a non-empty list of non-empty strings")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable those.

    output_kind: "cumulative" (every output holds everything so far), "delta" (only what is new since
    the last output; streams) or "final_only" (one output when finished)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = dataclasses.field(default_factory=list)  # a string or None also accepted
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # None also accepted
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted; fast tokenizers (all we load) ignore it
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)
    # Beam search (serve/engine/beam_search.py; LLM.generate and the HTTP server route these requests there):
    use_beam_search: bool = False
    best_of: int | None = None  # beams (default n); the n best are returned
    length_penalty: float = 1.0  # a hypothesis scores sum(logprob) / generated_len ** length_penalty
    early_stopping: bool | Literal["never"] = False  # as in transformers

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        def check_int(field: str, lo: int, hi: int, optional: bool = False) -> None:
            value = getattr(self, field)
            if value is None and optional:
                return
            if not _is_int(value) or not lo <= value <= hi:
                raise bad(field, f"must be an int in [{lo}, {hi}]" + (" or None" if optional else ""))

        # The device samples in float32: a value must stay finite there, and not flush to 0 unless it is 0.
        f32_max, f32_min_normal = 3.4028234663852886e38, 1.1754943508222875e-38
        # Logits are divided by the temperature and the repetition penalty (or multiplied by the latter):
        # within these bounds even 1e6-sized logits stay far inside float32's range.
        min_temperature, repetition_range = 1e-10, (1e-10, 1e10)

        def check_float(field: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -f32_max <= value <= f32_max:
                raise bad(field, "must be a number that is finite in float32")
            if value < lo or value > hi or (lo_open and value == lo):
                raise bad(field, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
            if value != 0 and abs(value) < f32_min_normal:
                raise bad(field, f"must be 0 or at least {f32_min_normal:.2g} in magnitude (float32 reads it as 0)")
            setattr(self, field, float(value))

        check_int("n", 1, INT32_MAX)
        check_float("temperature", 0.0, math.inf)
        if 0 < self.temperature < min_temperature:
            raise bad("temperature", f"must be 0 (greedy) or at least {min_temperature:g} (logits are divided by it)")
        check_float("top_p", 0.0, 1.0, lo_open=True)
        if self.top_k == -1:
            self.top_k = 0
        check_int("top_k", 0, INT32_MAX)
        check_float("min_p", 0.0, 1.0)
        check_float("presence_penalty", -2.0, 2.0)
        check_float("frequency_penalty", -2.0, 2.0)
        check_float("repetition_penalty", *repetition_range)
        check_int("seed", INT64_MIN, INT64_MAX, optional=True)
        check_int("max_tokens", 1, INT32_MAX, optional=True)
        check_int("min_tokens", 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        check_int("logprobs", 0, MAX_LOGPROBS, optional=True)
        check_int("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        if self.output_kind not in ("cumulative", "delta", "final_only"):
            raise bad("output_kind", "must be 'cumulative', 'delta' or 'final_only'")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))) or not all(isinstance(s, str) for s in self.stop or []):
            raise bad("stop", "must be a string or a list of strings")
        self.stop = [s for s in (self.stop or []) if s]
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, type(None))) or not all(
            _is_int(t) and 0 <= t <= INT32_MAX for t in ids or []
        ):
            raise bad("stop_token_ids", f"must be a list of ints in [0, {INT32_MAX}]")
        self.stop_token_ids = list(ids or [])
        if self.min_tokens > 0 and len(set(self.stop_token_ids)) > MAX_BANNED_STOP_IDS:
            raise bad("stop_token_ids", f"may hold at most {MAX_BANNED_STOP_IDS} distinct ids when min_tokens > 0")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must be a dict of at most {MAX_LOGIT_BIAS} token ids to numbers")
            for token, value in bias.items():
                if not _is_int(token) or not 0 <= token <= INT32_MAX:
                    raise bad("logit_bias", f"keys must be token ids in [0, {INT32_MAX}]")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                    raise bad("logit_bias", "values must be numbers in [-100, 100]")
                if value != 0 and abs(value) < f32_min_normal:
                    raise bad("logit_bias", f"values must be 0 or at least {f32_min_normal:.2g} in magnitude")
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None
        check_int("best_of", self.n, INT32_MAX, optional=True)
        check_float("length_penalty", -32.0, 32.0)  # beam scores divide by generated_len ** it: finite within this
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", "must be true, false or 'never'")
        flags = (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "use_beam_search",
        )
        for field in flags:
            if not isinstance(getattr(self, field), bool):
                raise bad(field, "must be a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def device_seed(self) -> int | None:
        """The seed folded into the int32 range the device sampler keys from."""
        if self.seed is None:
            return None
        s = self.seed & 0xFFFFFFFFFFFFFFFF
        return (s ^ (s >> 32)) & 0x7FFFFFFF
