"""The server-level switch for lenient JSON schemas (vLLM's structured_outputs_config
disable_additional_properties): off by default; on, a schema whose request did not choose a reading
allows extra keys, while a request's own strict: true still closes it."""

from types import SimpleNamespace

import pytest

from serve.http.cli_args import build_parser, engine_args_from
from serve.http.generation import Generation
from serve.http.openai_protocol import CompletionRequest
from tests.test_strict_json import SCHEMA, accepts


def args_of(*argv: str):
    return engine_args_from(build_parser().parse_args(list(argv)))


def schema_reading(engine_args, strict: bool | None) -> bool | None:
    """additional_properties of the engine request a json_schema completion becomes on this server."""
    state = SimpleNamespace(
        engine=SimpleNamespace(args=engine_args, max_model_len=64), resolve_model=lambda model: None, model_name="m"
    )
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": strict}}
    gen = Generation(state, CompletionRequest(prompt="x", response_format=rf), [[1, 2]], None, 8)
    so = gen.params[0].structured_outputs
    assert so is not None
    return so.additional_properties


def test_flag_parses_and_is_checked():
    assert not args_of().lenient_json_schemas()
    lenient = args_of("--structured-outputs-config", '{"disable_additional_properties": false}')
    assert lenient.lenient_json_schemas()
    assert not args_of("--structured-outputs-config", '{"disable_additional_properties": true}').lenient_json_schemas()
    with pytest.raises(ValueError, match="structured-outputs-config takes only disable_additional_properties"):
        args_of("--structured-outputs-config", '{"backend": "xgrammar"}')
    with pytest.raises(ValueError, match="disable_additional_properties must be a bool"):
        args_of("--structured-outputs-config", '{"disable_additional_properties": "no"}')


def test_server_default_applies_only_where_the_request_left_it():
    strict_server = args_of()
    lenient_server = args_of("--structured-outputs-config", '{"disable_additional_properties": false}')
    assert [schema_reading(strict_server, s) for s in (None, True, False)] == [None, False, True]
    assert [schema_reading(lenient_server, s) for s in (None, True, False)] == [True, False, True]
    reading = schema_reading(lenient_server, None)
    assert accepts(SCHEMA, '{"a":1,"b":2}', additional_properties=reading)  # the grammar the engine then builds
    assert not accepts(SCHEMA, '{"a":1,"b":2}', additional_properties=schema_reading(strict_server, None))
