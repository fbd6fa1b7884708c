"""Tokenizer loading (tokenizer.json via the ``tokenizers`` library), chat templates rendered in a
sandboxed jinja environment, and an incremental detokenizer for streaming and stop strings."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatEncoder", "IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]

#: A checkpoint's chat format written in code, for releases that ship no Jinja template (DeepSeek-V4):
#: ``encoder(messages, add_generation_prompt, **template_variables) -> prompt text``.
ChatEncoder = Callable[..., str]


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` plus the bits of ``tokenizer_config.json`` serving needs."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file {file} not found")
        self._tok = _HFTokenizer.from_file(str(file))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        self.chat_template: str | None = cfg.get("chat_template")
        if self.chat_template is None and (path / "chat_template.jinja").is_file():
            self.chat_template = (path / "chat_template.jinja").read_text()
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if getattr(t, "special", False)}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template: tuple[str, Template] | None = None  # (source, compiled)
        # Used only when the checkpoint has no chat template: its own template always wins.
        self.chat_encoder: ChatEncoder | None = None
        # One token's text, by id: logprobs bodies name hundreds of thousands of tokens, mostly the
        # same few thousand; at most one entry per vocabulary id, so it stays bounded.
        self._token_texts: dict[int, str] = {}

    @property
    def can_chat(self) -> bool:
        """Whether chat messages can be rendered: a chat template, or a chat encoder the executor's plugin gives."""
        return bool(self.chat_template) or self.chat_encoder is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (memoised: the same id always decodes the same)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = str(self._tok.decode([token], skip_special_tokens=False))
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        if not self.chat_template and self.chat_encoder is not None:
            return self.chat_encoder(messages, add_generation_prompt=add_generation_prompt, **kw)
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json 'chat_template')")
        return self._compiled_template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kw,
        )

    def _compiled_template(self) -> Template:
        """The chat template compiled once per source text: compiling costs milliseconds, rendering microseconds."""
        source = self.chat_template
        assert source is not None
        if self._template is None or self._template[0] != source:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = _tojson
            self._template = (source, env.from_string(source))
        return self._template[1]


def _raise(msg: str) -> None:
    raise ValueError(f"chat template error: {msg}")


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' ``tojson``: jinja's own sorts keys and HTML-escapes ``<>&'``, changing prompts."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str | Path | None, chat_encoder: ChatEncoder | None = None) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it ships no tokenizer.json. ``chat_encoder``
    renders chats when the directory has no chat template (see ``pypto_serving_chat_encoder``)."""
    if path is None or not (Path(path) / "tokenizer.json").is_file():
        return None
    tok = Tokenizer(Path(path))
    tok.chat_encoder = chat_encoder
    return tok


class IncrementalDetokenizer:
    """Decodes a growing token list in O(total length): each step decodes only a short window
    (from ``prefix`` to the end) and emits the text past what the window already produced. Text that
    ends in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-6:])  # a little context so the first word decodes with its spacing
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.stopped_at: str | None = None
        self.num_outputs = 0  # output tokens appended so far

    def append(self, token: int, check_stop: bool = True) -> bool:
        """Add one output token; returns True when a stop string ends in the text it added (the text
        is then cut before it). With ``check_stop`` false (before ``min_tokens``) nothing matches,
        and a stop string that ended in that text never matches later either."""
        self.num_outputs += 1
        self.ids.append(token)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return False
        new = full[len(prefix_text) :]
        self.prefix, self.read = self.read, len(self.ids)
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += new
        if self.stop and check_stop:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                self.stopped_at = s
                return True
        return False
