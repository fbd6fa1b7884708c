"""Helpers for the server tests: a tiny byte-level BPE tokenizer with a ChatML template, fake and Qwen
model directories that use it, SSE parsing and a free-port finder. A uniquely named module (not
conftest) so test files import it the same way under any pytest import mode."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
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


# --------------------------------------------------------------------------- real server processes


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them (``/proc/<pid>/task/<pid>/children``
    lists only the main thread's; the worker is spawned by the engine thread)."""
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    for task in task_dir.iterdir() if task_dir.exists() else ():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            out += [int(x) for x in (task / "children").read_text().split()]
    return sorted(out)


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def thread_masks(pid: int) -> set[frozenset[int]]:
    """The distinct CPU affinity masks of process ``pid``'s threads."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def core_pids(pid: int) -> list[int]:
    """The live engine-core processes of a ``serve`` process (``engine_mode = "process"``)."""
    return [c for c in child_pids(pid) if b"pypto_serving.server.engine_proc" in _cmdline(c) and is_running(c)]


def worker_pids(pid: int) -> list[int]:
    """The live engine workers of a ``serve`` process: the children started by multiprocessing's spawn
    (not its resource tracker) of its engine-core process, or of itself in thread mode."""
    workers = []
    for parent in [pid, *core_pids(pid)]:
        workers += [c for c in child_pids(parent) if b"spawn_main" in _cmdline(c) and is_running(c)]
    return sorted(workers)


def descendant_pids(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children...)."""
    out: list[int] = []
    todo = child_pids(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += child_pids(child)
    return sorted(out)


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def metric(text: str, name: str) -> float:
    """The value of the unlabelled-or-single-series Prometheus sample ``name`` in ``text`` (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def json_bytes(body: dict[str, Any]) -> bytes:
    """``body`` as ASCII JSON: lone surrogates go out as ``\\ud800`` escapes (httpx's ``json=`` cannot send them)."""
    return json.dumps(body).encode()


def poison_requests() -> list[tuple[str, str, dict[str, Any], str]]:
    """(case id, path, body, the ``param`` the 400 must name): values that once reached the engine unchecked."""
    big = 2**64
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("top_k-2**64", cmpl, {"prompt": "hi", "top_k": big}, "top_k"),
        ("seed-2**64", cmpl, {"prompt": "hi", "seed": big}, "seed"),
        ("seed--2**64", cmpl, {"prompt": "hi", "seed": -big}, "seed"),
        ("stop_token_ids-2**64", cmpl, {"prompt": "hi", "stop_token_ids": [big]}, "stop_token_ids"),
        ("min_tokens-2**64", cmpl, {"prompt": "hi", "min_tokens": big}, "min_tokens"),
        ("max_tokens-2**64", cmpl, {"prompt": "hi", "max_tokens": big}, "max_tokens"),
        ("logprobs-2**64", cmpl, {"prompt": "hi", "logprobs": big}, "logprobs"),
        ("prompt-ids-2**64", cmpl, {"prompt": [big]}, "prompt"),
        ("stop-surrogate", cmpl, {"prompt": "hi", "stop": "\ud800"}, "stop"),
        ("stop-list-surrogate", cmpl, {"prompt": "hi", "stop": ["a", "\ud800"]}, "stop"),
        ("prompt-surrogate", cmpl, {"prompt": "\ud800"}, "prompt"),
        ("prompt-list-surrogate", cmpl, {"prompt": ["ok", "\ud800"]}, "prompt"),
        ("chat-content-surrogate", chat, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ("chat-seed-2**64", chat, {"messages": msgs, "seed": big}, "seed"),
        ("chat-stop-surrogate", chat, {"messages": msgs, "stop": "\ud800"}, "stop"),
        ("chat-top_k-2**64", chat, {"messages": msgs, "top_k": big}, "top_k"),
    ]


def attack_requests() -> list[tuple[str, str, dict[str, Any], str | None]]:
    """(case id, path, body, the ``param`` the 400 must name): the issue-25 attacks that once answered
    500 or froze the server. The response-size case needs ``max_response_bytes`` under 2 MB."""
    chat = "/v1/chat/completions"
    cmpl = "/v1/completions"
    user = {"role": "user", "content": "hi"}
    deep_call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    deep_history = [user, {"role": "assistant", "content": None, "tool_calls": [deep_call]}]
    deep_bias: Any = 1
    for _ in range(200):
        deep_bias = [deep_bias]
    return [
        ("regex-explosion", cmpl, {"prompt": "hi", "guided_regex": "(?:a{1000}){1000}"}, "guided_regex"),
        ("regex-no-extension", chat, {"messages": [user], "guided_regex": "[^\\x00-\\x{10FFFF}]"}, "guided_regex"),
        ("schema-ref-loop", cmpl, {"prompt": "hi", "n": 8, "guided_json": {"$ref": "#"}}, "guided_json"),
        ("deep-tool-arguments", chat, {"messages": deep_history, "stream": True}, "messages"),
        ("deep-body", cmpl, {"prompt": "hi", "logit_bias": {"5": deep_bias}}, None),
        ("response-too-large", cmpl, {"prompt": "hi", "n": 16, "logprobs": 20, "max_tokens": 200}, "logprobs"),
    ]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (and return that);
    after ``timeout`` an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
