"""IncrementalDetokenizer on a small byte-level BPE tokenizer with multi-byte characters."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from pypto_serving.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "hello world, the café is open",
    "naïve résumé for the hello world",
    "lower lowest newer wider",
] * 20
TEXTS = [
    "hello café wörld 🙂 done",
    "résumé 🚀🚀 é è ê ü",
    "plain ascii text only",
    "日本語のテキスト and 🙂",
]
SPECIAL = "<|end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[SPECIAL], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(CORPUS, trainer)
    d = tmp_path_factory.mktemp("tok")
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL}))
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    t = load_tokenizer(tok_dir)
    assert t is not None
    return t


def stream(tok: Tokenizer, prompt: list[int], out: list[int], **kw: Any) -> tuple[IncrementalDetokenizer, list[str]]:
    d = IncrementalDetokenizer(tok, prompt, kw.pop("stop", []), **kw)
    seen = []
    for t in out:
        d.append(t)
        seen.append(d.text)
    return d, seen


def test_fixture_splits_characters_across_tokens(tok: Tokenizer) -> None:
    """The test is only meaningful if some token decodes to a partial character."""
    ids = tok.encode("🙂 é")
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert tok.eos_token_id is not None and tok.eos_token_id in tok.special_ids


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt_text", ["", "hello ", "é🙂"])
def test_streaming_never_shows_replacement_chars_and_ends_equal(tok: Tokenizer, text: str, prompt_text: str) -> None:
    prompt = tok.encode(prompt_text)
    ids = tok.encode(text)
    d, seen = stream(tok, prompt, ids)
    for partial in seen:
        assert "\ufffd" not in partial
    for a, b in itertools.pairwise(seen):
        assert b.startswith(a)  # text only grows
    assert d.text == text == tok.decode(ids)


def test_streaming_with_long_context_prompt(tok: Tokenizer) -> None:
    prompt = tok.encode("a long prompt with café 🙂 " * 5)
    ids = tok.encode("🙂🙂 résumé")
    d, _ = stream(tok, prompt, ids)
    assert d.text == "🙂🙂 résumé"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(["wörld"], "hello café "), (["🙂"], "hello café wörld "), (["fé w"], "hello ca"), (["zzz"], TEXTS[0])],
)
def test_stop_strings_truncate(tok: Tokenizer, stop: list[str], expected: str) -> None:
    ids = tok.encode(TEXTS[0])
    d = IncrementalDetokenizer(tok, [], stop)
    hit_at = None
    for i, t in enumerate(ids):
        if d.append(t):
            hit_at = i
            break
    assert d.text == expected
    if stop == ["zzz"]:
        assert hit_at is None and d.stopped_at is None
    else:
        assert hit_at is not None and d.stopped_at == stop[0]


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [], ["done", "café"])
    stopped = any(d.append(t) for t in tok.encode(TEXTS[0]))
    assert stopped and d.text == "hello " and d.stopped_at == "café"


def test_skip_special_tokens(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    ids = [*tok.encode("hello"), eos, *tok.encode(" world")]
    skipped, _ = stream(tok, [], ids, skip_special_tokens=True)
    kept, _ = stream(tok, [], ids, skip_special_tokens=False)
    assert skipped.text == "hello world"
    assert kept.text == f"hello{SPECIAL} world"


def test_decode_cost_is_linear(tok: Tokenizer) -> None:
    text = "hello café wörld 🙂 the résumé " * 40
    ids = tok.encode(text)
    assert len(ids) > 300
    calls = 0
    decoded = 0
    real = tok.decode

    def counting(chunk: list[int], skip: bool = True) -> str:
        nonlocal calls, decoded
        calls += 1
        decoded += len(chunk)
        return real(chunk, skip)

    tok.decode = counting  # type: ignore[method-assign]
    try:
        d, _ = stream(tok, tok.encode("prompt " * 20), ids)
    finally:
        del tok.decode
    assert d.text == text
    assert calls <= 2 * len(ids)
    assert decoded <= 20 * len(ids)  # a window of a few tokens per step, not the whole history
