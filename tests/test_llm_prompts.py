"""LLM.generate takes vLLM's prompt forms: text, token ids, {"prompt": ...}, {"prompt_token_ids": [...]}
(with an optional cache_salt), and lists mixing them; a bad one is a ValueError naming the field."""

from __future__ import annotations

import pytest

from serve import LLM
from serve.engine.prompt_inputs import PromptInput, parse_prompts
from tests.serve_helpers import ENGINE_DEFAULTS, GREEDY

IDS = list(range(3, 43))  # 40 tokens: five full blocks of 8


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE_DEFAULTS)


def test_the_forms_give_the_same_answers_in_order(llm):
    outs = llm.generate(
        ["The sky", IDS, {"prompt": "The sky"}, {"prompt_token_ids": IDS, "prompt": "a label"}], GREEDY, use_tqdm=False
    )
    text, ids, text_dict, ids_dict = outs
    assert text_dict.prompt == "The sky" and text_dict.prompt_token_ids == text.prompt_token_ids
    assert ids_dict.prompt_token_ids == ids.prompt_token_ids == IDS
    assert text_dict.outputs[0].token_ids == text.outputs[0].token_ids
    assert ids_dict.outputs[0].token_ids == ids.outputs[0].token_ids
    assert text.outputs[0].token_ids != ids.outputs[0].token_ids  # the two prompts really differ
    (single,) = llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == ids.outputs[0].token_ids


def test_cache_salt_separates_prefix_caches(llm):
    llm.generate({"prompt_token_ids": IDS, "cache_salt": "a"}, GREEDY, use_tqdm=False)
    same, other = llm.generate(
        [{"prompt_token_ids": IDS, "cache_salt": "a"}, {"prompt_token_ids": IDS, "cache_salt": "b"}],
        GREEDY,
        use_tqdm=False,
    )
    assert same.num_cached_tokens >= 32 and other.num_cached_tokens == 0


def test_single_prompts_and_lists_parse_as_vllm_does():
    assert parse_prompts("hi") == [PromptInput("hi")]
    assert parse_prompts([1, 2]) == [PromptInput([1, 2])]
    assert parse_prompts([[1, 2], "hi", {"prompt": "x", "cache_salt": "s"}]) == [
        PromptInput([1, 2]),
        PromptInput("hi"),
        PromptInput("x", "s"),
    ]
    assert parse_prompts([]) == []


@pytest.mark.parametrize(
    "prompts,field",
    [
        ({"text": "hi"}, "prompts.text is not supported"),
        ([{"prompt": "ok"}, {}], "prompts[1] needs 'prompt' or 'prompt_token_ids'"),
        ([{"prompt": 3}], "prompts[0].prompt must be a string"),
        ({"prompt_token_ids": "abc"}, "prompts.prompt_token_ids must be a non-empty list of ints"),
        ({"prompt_token_ids": [1, 2.5]}, "prompts.prompt_token_ids must be a non-empty list of ints"),
        ({"prompt": "x", "cache_salt": 1}, "prompts.cache_salt must be a string"),
        (["ok", 3.5], "prompts[1] must be a string, token ids or a prompt dict"),
        (7, "prompts must be a prompt or a list of prompts"),
    ],
)
def test_a_bad_prompt_is_a_value_error_naming_the_field(prompts, field):
    with pytest.raises(ValueError) as e:
        parse_prompts(prompts)
    assert field in str(e.value)


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]\.prompt_token_ids"):
        llm.generate([{"prompt": "ok"}, {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
