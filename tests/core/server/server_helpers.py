"""Helpers for the server tests: a tiny byte-level BPE tokenizer with a ChatML template, fake and Qwen
model directories that use it, SSE parsing and a free-port finder. A uniquely named module (not
conftest) so test files import it the same way under any pytest import mode."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for serving tests",
    "once upon a time there was a small language model that liked to count: one two three four five",
    "streaming responses end with done; every chunk is a server sent event",
    "the cat sat on the mat and the dog sat on the log",
    "numbers 0123456789 and punctuation !?.,;: are bytes too",
] * 4


def write_tokenizer(path: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens into ``path``; returns the size.

    Byte-level so any text encodes, and the exact size lets the executor's vocab match it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # type: ignore[assignment]
    tok.decoder = decoders.ByteLevel()  # type: ignore[assignment]
    trainer = trainers.BpeTrainer(  # type: ignore[call-arg]
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == vocab_size, f"corpus too small: trained {size} tokens, wanted {vocab_size}"
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None})
    )
    return size


def write_fake_model(path: Path, vocab_size: int = 320) -> Path:
    write_tokenizer(path, vocab_size)
    (path / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_sse(text: str) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of an SSE body and whether it ended with ``data: [DONE]``."""
    events: list[dict[str, Any]] = []
    done = False
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        assert not done, "event after [DONE]"
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    return events, done
