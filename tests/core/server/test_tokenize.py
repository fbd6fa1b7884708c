"""vLLM's /tokenize and /detokenize: the ids the ``tokenizers`` library itself gives, chat messages
rendered exactly as /v1/chat/completions renders them (the count equals its prompt_tokens), and the
usual OpenAI errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


@pytest.fixture
def client(make_client: Callable[..., tuple[Any, Any]]) -> Any:
    return make_client()[0]


def _reference(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_tokenize_a_prompt(client: Any, fake_model_dir: Path) -> None:
    text = "the quick brown fox, 0123!"
    r = client.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    ids = _reference(fake_model_dir).encode(text).ids
    assert r.json() == {"count": len(ids), "max_model_len": 128, "tokens": ids, "token_strs": None}
    strs = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(ids) and "".join(strs) == text


def test_tokenize_messages_counts_what_chat_completions_prompts(client: Any, fake_model_dir: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    rendered = "".join(CHATML.format(**m) for m in messages) + "<|im_start|>assistant\n"
    assert r.json()["tokens"] == _reference(fake_model_dir).encode(rendered, add_special_tokens=False).ids
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert r.json()["count"] == chat["usage"]["prompt_tokens"]
    no_prompt = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == r.json()["tokens"][: no_prompt["count"]] and no_prompt["count"] < r.json()["count"]


def test_detokenize_round_trip(client: Any, fake_model_dir: Path) -> None:
    text = "<|im_start|>user\nonce upon a time<|im_end|>"
    ids = _reference(fake_model_dir).encode(text).ids
    r = client.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}  # special tokens are kept, as vLLM keeps them
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/detokenize", {"tokens": [320]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "foo": 1}, 400, "foo"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}},
            400,
            "chat_template_kwargs",
        ),
    ],
)
def test_errors(client: Any, path: str, body: dict[str, Any], status: int, param: str | None) -> None:
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error
