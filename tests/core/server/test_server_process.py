"""``pypto-serving serve`` as a real subprocess on 127.0.0.1: the official ``openai`` client gets the
same greedy outputs as ``LLM.generate`` (Qwen executor with a tiny tokenizer), SIGTERM drains
in-flight streams and exits 0, start-up problems print one line and exit non-zero, and the server
and its engine core keep off a pinned worker's cores."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("pypto_serving_sync_sched")

from tests.core.server.server_helpers import (
    core_pids,
    free_port,
    parse_sse,
    thread_masks,
    worker_pids,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[3]
SERVE = [sys.executable, "-m", "pypto_serving.cli", "serve"]
COMMON = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--worker-mode",
    "inproc",
    "--block-size",
    "4",
    "--num-kv-blocks",
    "512",
    "--scheduler",
    "sync",
]


def _env() -> dict[str, str]:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("PYPTO_SERVING_PLUGINS", None)
    return env


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pypto_serving_qwen")
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    path = make_qwen_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny-qwen", "qwen3", num_hidden_layers=2)
    write_tokenizer(path, 320)  # TINY vocab_size is 320
    return path


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.p = subprocess.Popen(
            [*SERVE, *args, "--port", str(self.port)],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=ROOT,
        )

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.p.poll() is None, self.log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("server did not become healthy:\n" + self.log.read_text())

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    procs: list[Proc] = []

    def start(*args: str) -> Proc:
        proc = Proc(list(args), tmp_path / f"server{len(procs)}.log")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()  # always, whatever the test did


def test_openai_client_matches_llm_generate(qwen_dir: Path, serve: Any) -> None:
    import openai

    from pypto_serving import LLM, SamplingParams

    proc = serve("--model", str(qwen_dir), *COMMON)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with LLM(
        model=str(qwen_dir),
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        block_size=4,
        num_kv_blocks=512,
        scheduler="sync",
    ) as llm:
        prompts = ["hello world", "the quick brown fox"]
        ref = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
        ref_lp = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0]
        messages = [{"role": "user", "content": "count: one two"}]
        ref_chat = llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0]
    proc.wait_healthy()
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=30, max_retries=0)
    [model] = client.models.list().data
    assert model.id == "tiny-qwen"

    out = client.completions.create(model="tiny-qwen", prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [c.text for c in out.choices] == [ref[0].text, ref[0].text, ref[1].text, ref[1].text]
    assert [c.finish_reason for c in out.choices][::2] == [r.finish_reason for r in ref]
    assert out.usage is not None and out.usage.completion_tokens == 2 * sum(len(r.token_ids) for r in ref)

    lp = client.completions.create(model="tiny-qwen", prompt=prompts[0], max_tokens=8, temperature=0, logprobs=2)
    assert lp.choices[0].logprobs is not None
    got = lp.choices[0].logprobs.token_logprobs
    assert got == pytest.approx(
        [d[t] for t, d in zip(ref_lp.outputs[0].token_ids, ref_lp.outputs[0].logprobs or [])], abs=1e-4
    )

    chat = client.chat.completions.create(
        model="tiny-qwen",
        messages=messages,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].message.content == ref_chat.text
    assert chat.choices[0].logprobs is not None and len(chat.choices[0].logprobs.content or []) == len(
        ref_chat.token_ids
    )

    chunks = list(
        client.completions.create(
            model="tiny-qwen",
            prompt=prompts[1],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.text for ch in chunks for c in ch.choices) == ref[1].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ref[1].token_ids)

    chat_chunks = list(
        client.chat.completions.create(
            model="tiny-qwen",
            messages=messages,
            max_tokens=8,  # type: ignore[arg-type]
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.delta.content or "" for ch in chat_chunks for c in ch.choices) == ref_chat.text

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-qwen", prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")


def test_the_server_and_its_core_keep_off_the_workers_cores(qwen_dir: Path, serve: Any) -> None:
    """``engine_cpu_bind``: a spawned worker of one thread computes on the last core, and every thread
    of the server and of its engine-core process runs on the others, as listed (the server decides both
    before it narrows itself; 'auto' would leave them unpinned on a two-core machine)."""
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    args = [a if a != "inproc" else "process" for a in COMMON]
    rest = allowed - {max(allowed)}
    bind = ",".join(map(str, sorted(rest)))
    proc = serve("--model", str(qwen_dir), *args, "--worker-threads", "1", "--engine-cpu-bind", bind)
    proc.wait_healthy()
    r = httpx.post(proc.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    [core], [worker] = core_pids(proc.p.pid), worker_pids(proc.p.pid)
    assert thread_masks(proc.p.pid) == {rest} and thread_masks(core) == {rest}
    assert thread_masks(worker) == {frozenset({max(allowed)})}


def test_sigterm_drains_in_flight_and_exits_zero(qwen_dir: Path, serve: Any) -> None:
    proc = serve("--model", str(qwen_dir), *COMMON, "--shutdown-timeout", "30")
    proc.wait_healthy()
    result: dict[str, Any] = {}

    def run() -> None:
        with httpx.stream(
            "POST",
            proc.url + "/v1/completions",
            timeout=30,
            json={"prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True},
        ) as r:
            result["first"] = time.monotonic()
            result["body"] = "".join(r.iter_text())

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20
    while "first" not in result:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.p.send_signal(signal.SIGTERM)
    t.join(40)
    assert proc.p.wait(40) == 0, proc.log.read_text()
    events, done = parse_sse(result["body"])
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"  # drained, not cut
    assert sum(1 for e in events for c in e["choices"] if c["text"] or c["finish_reason"]) > 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--config", "/nonexistent/serve.toml"], "does not exist"),
        (["--model", "/nonexistent/model"], "does not exist"),
        (["--model", "{qwen}", "--executor", "nope"], "unknown executor 'nope'"),
        (["--model", "{qwen}", "--max-num-seqs", "zero"], "max_num_seqs"),
        (["--model", "{qwen}", "--port-in-use"], "cannot listen"),
    ],
)
def test_startup_errors_are_one_line_and_nonzero(qwen_dir: Path, args: list[str], needle: str) -> None:
    args = [a.replace("{qwen}", str(qwen_dir)) for a in args]
    blocker = None
    if "--port-in-use" in args:
        args.remove("--port-in-use")
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        args += ["--port", str(blocker.getsockname()[1])]
    else:
        args += ["--port", str(free_port())]
    try:
        r = subprocess.run([*SERVE, *args, *COMMON], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    finally:
        if blocker is not None:
            blocker.close()
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.startswith("pypto-serving: error:")]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
