"""The tokenizer's chat template is compiled once and renders the same text every time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from pypto_serving.tokenizer import Tokenizer
from tests.core.server.server_helpers import write_fake_model


def test_the_chat_template_is_compiled_once(tmp_path: Path, monkeypatch: Any) -> None:
    tok = Tokenizer(write_fake_model(tmp_path / "m"))
    assert tok.chat_template
    compiled = 0
    from_string = ImmutableSandboxedEnvironment.from_string

    def counting(self: Any, source: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        compiled += 1
        return from_string(self, source, *args, **kwargs)

    monkeypatch.setattr(ImmutableSandboxedEnvironment, "from_string", counting)
    messages = [{"role": "user", "content": "hi"}]
    first = tok.apply_chat_template(messages)
    assert [tok.apply_chat_template(messages) for _ in range(3)] == [first] * 3
    assert "hi" in first
    assert compiled == 1


def test_a_changed_chat_template_is_compiled_again(tmp_path: Path) -> None:
    tok = Tokenizer(write_fake_model(tmp_path / "m"))
    messages = [{"role": "user", "content": "hi"}]
    tok.apply_chat_template(messages)
    tok.chat_template = "{{ messages[0]['content'] }}!"
    assert tok.apply_chat_template(messages) == "hi!"
