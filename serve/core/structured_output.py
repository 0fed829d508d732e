"""Structured outputs through llguidance: a request's constraint becomes a grammar, a matcher per
sequence follows the sampled tokens, and each step it writes the allowed next tokens as a bitmask
(one bit per vocabulary id, 32 per int32 word) that the sampler applies on device.

llguidance rather than xgrammar: it needs no torch (its masks are numpy arrays), ships one abi3
wheel for every Python we run, and compiles JSON schemas lazily, so a new schema costs no
up-front grammar compilation on the serving path.
"""

from __future__ import annotations

import copy
import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from serve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the grammar checker's child imports this module: it stays clear of jax
    from llguidance._lib import JsonCompileOptions

    from jaxinfra.tokenizer import Tokenizer

# Compact JSON (", " and ": " separators, as json.dumps writes) unless a schema asks otherwise.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, not schemas


def without_additional_properties(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema that lists `properties` and does not say
    otherwise forbids other keys (`additionalProperties: false`), as vLLM's default backend reads it."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        if not isinstance(node, dict):
            continue
        if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key not in NOT_SCHEMAS:
                stack.append(value)
    return schema


def grammar_of(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked: see GrammarCompiler.validate)."""
    if so.json is not None:
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        if not so.additional_properties:
            schema = without_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if so.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if so.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in so.choice))
    assert so.grammar is not None
    return llguidance.LLMatcher.grammar_from_lark(so.grammar)


Matcher = llguidance.LLMatcher


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's work budgets: the initial fuel bounds building a grammar's lexer (a fifth of
    llguidance's default: real schemas and regexes build in a few ms, and "(a{1000}){1000}" is refused
    after ~0.1 s of a core instead of ~1 s); step fuel and Earley items (its defaults) bound each token
    mask (~15 ms), past which the matcher fails instead of running on."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=200_000, step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False
    )


def validate(so: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer, limits: llguidance.LLParserLimits) -> str:
    """The grammar of a constraint; ValueError naming the field if it is not a valid one (a schema
    nested past Python's recursion limit included)."""
    try:
        grammar = grammar_of(so)
    except RecursionError as e:
        raise ValueError("structured_outputs: the JSON schema is nested too deeply") from e
    except (ValueError, TypeError) as e:  # an unparsable JSON schema string, a bad schema
        raise ValueError(f"structured_outputs: {e}") from e
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
    if error:
        raise ValueError(f"structured_outputs: {error}")
    return grammar


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def failure(matcher: Matcher) -> str:
    """Why a matcher in its error state failed, in one line, as a request's error."""
    return f"structured_outputs: the grammar failed: {matcher.get_error().splitlines()[0]}"


COMPILE_WORKERS = 2


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer (its tokenizer.json) for a model of `vocab_size` ids."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)


class GrammarCompiler:
    """Grammars and matchers over one tokenizer, for a model whose vocabulary has `vocab_size` ids
    (ids the tokenizer does not know are never allowed). `compile` builds matchers on worker threads
    (llguidance drops the GIL), so a costly grammar never holds up the step loop."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        eos = list(eos_token_ids or tokenizer.eos_token_ids)
        self.tokenizer = ll_tokenizer(tokenizer.tok.to_str(), vocab_size, eos)
        self.executor = llguidance.LLExecutor()
        self.limits = parser_limits()
        self.workers = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar")

    def validate(self, so: StructuredOutputsParams) -> str:
        """The grammar of a constraint; ValueError naming the field if it is not a valid one."""
        return validate(so, self.tokenizer, self.limits)

    def matcher(self, so: StructuredOutputsParams) -> Matcher:
        """A fresh matcher at the start of the output."""
        m = llguidance.LLMatcher(self.tokenizer, grammar_of(so), log_level=0, limits=self.limits)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m

    def compile(self, so: StructuredOutputsParams, n: int) -> Future[list[Matcher]]:
        """`n` matchers for a constraint, made on a worker thread (see _compiled)."""
        return self.workers.submit(self._compiled, so, n)

    def _compiled(self, so: StructuredOutputsParams, n: int) -> list[Matcher]:
        """`n` matchers at the start of the output whose lexer has done its lazy first work: the first
        token mask, and the mask after one allowed token (a pathological grammar spends its budget
        there, and fails here rather than in the step). ValueError with llguidance's reason if it fails."""
        m = self.matcher(so)
        mask = np.zeros((1, bitmask_words(self.vocab_size)), np.int32)
        llnp.fill_next_token_bitmask(m, mask, 0)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        probe = m.deep_copy()
        if len(allowed) and probe.consume_token(int(allowed[0])):
            llnp.fill_next_token_bitmask(probe, mask, 0)
        for matcher in (m, probe):
            if matcher.is_error():
                raise ValueError(failure(matcher))
        return [m, *(m.deep_copy() for _ in range(n - 1))]

    def fill(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed next tokens into row `index` of `bitmask` [S, words]."""
        if matchers:
            llnp.fill_next_token_bitmask_par(self.executor, matchers, bitmask)
