"""Tokenizer: HF `tokenizer.json` via the tokenizers library, special tokens and chat templates."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers
import tokenizers.trainers
from tokenizers import decoders, models, pre_tokenizers, processors

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
BYTE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>")
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` markers and renders their body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it a set

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does, in an immutable sandbox."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """Text <-> token ids, HF-compatible special tokens and chat-template rendering."""

    def __init__(
        self, tok: tokenizers.Tokenizer, config: dict[str, Any] | None = None, extra_eos_ids: tuple[int, ...] = ()
    ) -> None:
        self.tok = tok
        self.config = dict(config or {})
        self.special_tokens = {
            k: _token_content(self.config.get(k))
            for k in SPECIAL_TOKEN_KEYS
            if _token_content(self.config.get(k)) is not None
        }
        template = self.config.get("chat_template")
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}.get("default")
        self.chat_template: str | None = template
        eos = self.special_tokens.get("eos_token")
        ids = [self.token_to_id(eos)] if eos is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in [*ids, *extra_eos_ids] if i is not None))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        if (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        extra: tuple[int, ...] = ()
        if (path / "generation_config.json").is_file():
            eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
            extra = tuple([eos] if isinstance(eos, int) else eos or [])
        return cls(tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")), config, extra)

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """A byte-level tokenizer (256 byte tokens + specials) for random-weight presets."""
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.add_special_tokens(list(BYTE_SPECIALS))
        return cls._with_chat_specials(tok)

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """A byte-level BPE tokenizer trained on `texts` (GPT-2 style word splitting), with the same
        special tokens and chat template as byte_level(); the specials take ids 0-4."""
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(BYTE_SPECIALS),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer)
        return cls._with_chat_specials(tok)

    @classmethod
    def _with_chat_specials(cls, tok: tokenizers.Tokenizer) -> Tokenizer:
        tok.decoder = decoders.ByteLevel()
        bos = BYTE_SPECIALS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        config = {
            "bos_token": BYTE_SPECIALS[0],
            "eos_token": BYTE_SPECIALS[1],
            "chat_template": BYTE_CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        return cls(tok, config)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable by transformers' AutoTokenizer)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(path / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config}
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[True],
        **kwargs: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        **kwargs: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template; ids without re-adding BOS if tokenize."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        text = _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
