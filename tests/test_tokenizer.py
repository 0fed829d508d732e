"""Tokenizer and chat templates against transformers' PreTrainedTokenizerFast / apply_chat_template."""

import json

import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizerCore
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import jaxinfra
from jaxinfra.tokenizer import Tokenizer

CORPUS = [
    "In the beginning was the word, and the word was with code.",
    "Tokenizers split text into pieces; pieces become ids.",
    "héllo wörld — ünïcode ✓",
] * 20

CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_LIKE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
GENERATION_TAGS = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "A: {{ m.content }}{% endgeneration %}{% else %}U: {{ m.content }}{% endif %}\n{% endfor %}"
)
MESSAGES = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": " Hello! "},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A BPE tokenizer trained here, saved by transformers with a Llama-3-like template."""
    core = HFTokenizerCore(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    core.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    core.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    hf.chat_template = LLAMA3_LIKE
    path = tmp_path_factory.mktemp("tok")
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return path


def test_encode_decode_match_transformers(hf_tokenizer_dir):
    ours = jaxinfra.load_tokenizer(hf_tokenizer_dir)
    hf = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    for text in ["In the beginning was the word", "héllo wörld ✓ and new words", ""]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids
        assert ids[0] == 0  # BOS from the post-processor
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False).input_ids


def test_special_tokens_and_eos_ids(hf_tokenizer_dir):
    ours = jaxinfra.load_tokenizer(hf_tokenizer_dir)
    assert ours.special_tokens["bos_token"] == "<|begin_of_text|>"
    assert ours.eos_token_ids == (1, 3)  # tokenizer_config eos, then generation_config's


def test_llama3_template_matches_apply_chat_template(hf_tokenizer_dir):
    ours = jaxinfra.load_tokenizer(hf_tokenizer_dir)
    hf = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    system = [{"role": "system", "content": "  Be terse.  "}, *MESSAGES]
    for messages in (MESSAGES, system):
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    ids = ours.apply_chat_template(MESSAGES, tokenize=True)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ids == hf(rendered, add_special_tokens=False).input_ids


def test_template_raise_exception_surfaces(hf_tokenizer_dir):
    ours = jaxinfra.load_tokenizer(hf_tokenizer_dir)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        ours.apply_chat_template(bad)


@pytest.mark.parametrize("template", [CHATML, GENERATION_TAGS])
def test_other_templates_match(hf_tokenizer_dir, template):
    hf = transformers.AutoTokenizer.from_pretrained(hf_tokenizer_dir)
    ours = jaxinfra.load_tokenizer(hf_tokenizer_dir)
    ours.chat_template = hf.chat_template = template
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "int", "ü": "ß"}}}]
    kwargs = {"tools": tools} if template is CHATML else {}
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs) == expected


def test_template_is_sandboxed(hf_tokenizer_dir):
    ours = jaxinfra.load_tokenizer(hf_tokenizer_dir)
    ours.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        ours.apply_chat_template(MESSAGES)


def test_byte_level_tokenizer_round_trips_and_saves(tmp_path):
    tok = Tokenizer.byte_level()
    text = "Byte-level: ünïcode ✓ and spaces  "
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|begin_of_text|>") and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf(text).input_ids == ids
    assert hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        MESSAGES
    )


def test_bad_messages_and_missing_template(tmp_path):
    tok = Tokenizer.byte_level()
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
