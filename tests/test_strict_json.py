"""JSON schemas are strict by default (objects hold only their listed keys unless the schema says
otherwise, as vLLM's default backend reads them); `additional_properties=True` gives JSON Schema's reading."""

import jaxinfra
from serve.core.structured_output import GrammarCompiler, without_additional_properties
from serve.sampling_params import StructuredOutputsParams
from tests.serve_helpers import PRESET

# The grammar writes compact JSON (structured_output.JSON_DEFAULTS).
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def accepts(schema: dict, text: str, **kwargs) -> bool:
    """Whether the grammar of `schema` lets the whole of `text` through and may end there."""
    tok = jaxinfra.load_tokenizer(PRESET)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    matcher = compiler.matcher(StructuredOutputsParams(json=schema, **kwargs))
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_extra_keys_are_refused_by_default_and_allowed_on_request():
    assert accepts(SCHEMA, '{"a":1}')
    assert not accepts(SCHEMA, '{"a":1,"b":2}')
    assert accepts(SCHEMA, '{"a":1,"b":2}', additional_properties=True)
    assert accepts({**SCHEMA, "additionalProperties": True}, '{"a":1,"b":2}')


def test_every_object_schema_is_closed_but_values_and_names_are_left_alone():
    schema = {
        "$defs": {"P": {"type": "object", "properties": {"properties": {"type": "string"}}}},
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "object", "properties": {"x": {}}}},
            "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": {"type": "integer"}},
        },
        "default": {"properties": {}},
    }
    strict = without_additional_properties(schema)
    assert strict["additionalProperties"] is False
    assert strict["$defs"]["P"] == {**schema["$defs"]["P"], "additionalProperties": False}
    assert strict["properties"]["items"]["items"]["additionalProperties"] is False
    assert strict["properties"]["open"]["additionalProperties"] == {"type": "integer"}
    assert strict["default"] == {"properties": {}} and "additionalProperties" not in schema  # a copy


def test_openai_strict_false_asks_for_the_lenient_reading():
    from serve.http.openai_protocol import CompletionRequest

    def so(strict):
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": strict}}
        return CompletionRequest(prompt="x", response_format=rf).structured()

    assert [so(s).additional_properties for s in (None, True, False)] == [None, False, True]  # None: the server's
