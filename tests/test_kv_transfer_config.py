"""`jaxinfra serve --role prefill|decode` and EngineArgs.kv_transfer_config (vLLM's JSON): what the
roles set, and a bad config is a ValueError naming its field (a CLI error naming the flag)."""

from __future__ import annotations

import pytest

from serve.config import EngineArgs, with_role
from serve.http.cli_args import build_parser, engine_args_from, name_flag
from serve.kv_transfer.shm_connector import SharedMemoryConnector


def _args(*argv: str) -> EngineArgs:
    """The engine arguments `jaxinfra serve` starts with."""
    args = build_parser().parse_intermixed_args(list(argv))
    return with_role(engine_args_from(args), args.role)


def test_roles_set_the_connector():
    assert _args().kv_transfer() is None
    prefill = _args("--role", "prefill").kv_transfer()
    assert prefill is not None and (prefill.kv_connector, prefill.kv_role) == ("SharedMemoryConnector", "kv_producer")
    decode = _args("--role", "decode", "--kv-transfer-config", '{"offer_timeout_s": 5}').kv_transfer()
    assert decode is not None and (decode.kv_role, decode.offer_timeout_s) == ("kv_consumer", 5)
    connector = decode.connector(block_size=16)
    assert isinstance(connector, SharedMemoryConnector) and connector.offers.timeout_s == 5


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_conector": "x"}, "kv_transfer_config takes only"),
        ({"kv_connector": "NixlConnector"}, "kv_transfer_config.kv_connector must be one of SharedMemoryConnector"),
        ({"kv_role": "producer"}, "kv_transfer_config.kv_role must be one of"),
        ({"offer_timeout_s": 0}, "kv_transfer_config.offer_timeout_s must be a number > 0"),
        ("yes", "kv_transfer_config takes only"),
    ],
)
def test_bad_config_names_its_field(config, message):
    with pytest.raises(ValueError, match=message) as e:
        EngineArgs(kv_transfer_config=config)
    assert name_flag(str(e.value)).startswith("argument --kv-transfer-config")
