"""The one finish rule (serve.core.sequence): the stop code the host and the decode loop compute alike,
and the finish reason both output paths (the host's results, the loop's stream) derive from it."""

import jax.numpy as jnp
import pytest

from serve import SamplingParams
from serve.core.sequence import STOP_EOS, STOP_ID, Sequence, finish_reason, stop_code


@pytest.mark.parametrize(
    "is_eos,is_stop_id,produced,min_tokens,check_eos,code",
    [
        (True, False, 1, 0, True, STOP_EOS),
        (True, True, 1, 0, True, STOP_EOS),  # EOS wins: no stop reason
        (True, True, 1, 0, False, STOP_ID),  # ignore_eos: the stop id still stops
        (True, False, 1, 0, False, 0),
        (False, True, 1, 0, True, STOP_ID),
        (False, True, 2, 3, True, 0),  # min_tokens not out yet
        (False, False, 5, 0, True, 0),
    ],
)
def test_stop_code_is_the_same_on_the_host_and_over_device_rows(
    is_eos, is_stop_id, produced, min_tokens, check_eos, code
):
    assert stop_code(is_eos, is_stop_id, produced, min_tokens, check_eos) == code
    rows = stop_code(*(jnp.array([v]) for v in (is_eos, is_stop_id, produced, min_tokens, check_eos)))
    assert rows.dtype == jnp.int32 and rows.tolist() == [code]


@pytest.mark.parametrize(
    "code,at_length,complete,expected",
    [
        (STOP_EOS, True, True, ("stop", None)),  # the stop rule first
        (STOP_ID, True, False, ("stop", 7)),  # a stop id is the stop reason
        (0, True, True, ("stop", None)),  # a complete grammar before length
        (0, True, False, ("length", None)),
        (0, False, False, (None, None)),
    ],
)
def test_finish_reason_orders_stop_rule_grammar_then_length(code, at_length, complete, expected):
    assert finish_reason(7, code, at_length, complete) == expected


def test_a_sequence_checks_its_counts_through_the_rule():
    """Sequence.stop_check: max_tokens and max_model_len are the length; min_tokens holds back EOS."""
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[9]), 0)
    seq.tokens.append(0)
    assert seq.stop_check(0, frozenset({0}), 100, False) == (None, None)  # EOS before min_tokens
    seq.tokens.append(9)
    assert seq.stop_check(9, frozenset({0}), 100, False) == ("stop", 9)
    seq.tokens[-1] = 5
    assert seq.stop_check(5, frozenset({0}), 5, False) == ("length", None)  # max_model_len
    assert seq.stop_check(5, frozenset({0}), 100, False) == (None, None)
    seq.tokens.append(6)
    assert seq.stop_check(6, frozenset({0}), 100, False) == ("length", None)  # max_tokens
