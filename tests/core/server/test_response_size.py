"""A small request may not ask for a huge answer: the response size is estimated from n, the prompts,
max_tokens and the logprob fields before the request is queued, and past ``max_response_bytes`` it
is a 400 naming the setting (the attack: a 3 KB request with n=128 and prompt_logprobs=20 answered
101 MB). Bodies are built and encoded off the event loop, so /health answers while the largest
allowed one is built (it blocked /health for seconds)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.server.conftest import LiveServer
from tests.core.server.server_helpers import parse_sse

pytestmark = pytest.mark.requires_plugin("sync_sched")

HI = [{"role": "user", "content": "hi"}]


def _tiny_qwen3() -> Any:
    return pytest.importorskip("pypto_serving_qwen.plugin").TINY_QWEN3


def _too_large(r: Any, param: str) -> None:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "response_too_large" and error["param"] == param, error
    assert "max_response_bytes=200000" in error["message"]


def test_a_request_asking_for_too_large_a_response_is_400(make_client: Any) -> None:
    client, llm = make_client(max_response_bytes=200_000)
    chat = {"messages": HI, "max_tokens": 50, "logprobs": True, "top_logprobs": 20}
    _too_large(client.post("/v1/chat/completions", json=chat | {"n": 4}), "top_logprobs")
    _too_large(client.post("/v1/chat/completions", json=chat | {"n": 4, "stream": True}), "top_logprobs")
    r = client.post("/v1/chat/completions", json=chat | {"n": 2})
    assert r.status_code == 200 and len(r.content) < 200_000, r.text[:300]
    events, done = parse_sse(client.post("/v1/chat/completions", json=chat | {"n": 2, "stream": True}).text)
    assert done and all("error" not in e for e in events)

    prompt = list(range(10, 110))
    _too_large(
        client.post("/v1/completions", json={"prompt": prompt, "n": 8, "prompt_logprobs": 20}), "prompt_logprobs"
    )
    body = {"prompt": [prompt] * 8, "echo": True, "logprobs": 5, "max_tokens": 1}
    _too_large(client.post("/v1/completions", json=body), "logprobs")
    # Without max_tokens every choice may fill the context (128 tokens here): 256 of them are too many.
    r = client.post("/v1/completions", json={"prompt": ["hi"] * 4, "n": 64, "max_tokens": None})
    _too_large(r, "max_tokens")
    assert llm.num_waiting() == 0


def _synthetic_body(kind: str, n: int, k: int | None, pk: int | None, echo: bool = False) -> tuple[int, int]:
    """(estimated, encoded) bytes of a response of the tiny Qwen3's tokenizer (a real 151k-token BPE)
    over English text, built by the server's own body builders from made-up outputs."""
    import msgspec

    from pypto_serving.request import CompletionOutput, RequestOutput, SamplingParams
    from pypto_serving.server.openai_requests import _Prompt, _response_parts
    from pypto_serving.server.protocol import ChatCompletionRequest, CompletionRequest
    from pypto_serving.server.responses import _chat_body, _completion_body
    from pypto_serving.tokenizer import Tokenizer

    rng = random.Random(0)
    tok = Tokenizer(_tiny_qwen3())
    text = "The quick brown fox jumps over the lazy dog; streaming servers answer every client in turn. " * 20
    ids = tok.encode(text)
    pids, oids = ids[:100], ids[100:180]

    def entry(t: int, top: int) -> dict[int, float]:
        d = {t: -rng.random() * 5}
        while len(d) < top + 1:
            d[rng.choice(ids)] = -rng.random() * 20
        return d

    outs = [
        CompletionOutput(i, oids, tok.decode(oids), "length", None, None if k is None else [entry(t, k) for t in oids])
        for i in range(n)
    ]
    scored = pk if pk is not None else (k if echo else None)
    prompt_lps = None if scored is None else [None, *(entry(t, scored) for t in pids[1:])]
    out = RequestOutput("r", None, pids, outs, True, prompt_logprobs=prompt_lps)
    prompt = _Prompt(pids, tok.decode(pids))
    from pypto_serving.config import ServingSettings

    llm = SimpleNamespace(tokenizer=tok, max_model_len=4096)
    ctx: Any = SimpleNamespace(llm=llm, model_name="m", settings=ServingSettings())
    req: Any
    if kind == "chat":
        req = ChatCompletionRequest(
            messages=HI, n=n, max_tokens=len(oids), logprobs=k is not None, top_logprobs=k, prompt_logprobs=pk
        )
        body = _chat_body(ctx, "r", req, prompt, out)
    else:
        req = CompletionRequest(prompt="x", n=n, max_tokens=len(oids), logprobs=k, prompt_logprobs=pk, echo=echo)
        body = _completion_body(ctx, "r", req, [prompt], [out])
    params = SamplingParams(n=n, max_tokens=len(oids), logprobs=k)
    return sum(_response_parts(ctx, req, [prompt], [params]).values()), len(msgspec.json.encode(body))


@pytest.mark.parametrize(
    ("kind", "k", "pk", "echo"),
    [
        ("completion", None, None, False),
        ("completion", 0, None, False),
        ("completion", 20, None, False),
        ("completion", 20, None, True),
        ("completion", None, 20, False),
        ("chat", None, None, False),
        ("chat", 0, None, False),
        ("chat", 20, None, False),
        ("chat", None, 20, False),
    ],
)
def test_the_estimate_covers_the_body_it_estimates(kind: str, k: int | None, pk: int | None, echo: bool) -> None:
    """Never under the real size (the limit holds), and within a small factor of it when the body is
    mostly logprobs (a fair request is not refused for a size it cannot reach)."""
    estimated, real = _synthetic_body(kind, 3, k, pk, echo)
    assert real <= estimated, (real, estimated)
    if k is not None or pk is not None:
        assert estimated < 1.5 * real, (real, estimated)


def test_health_answers_while_the_largest_allowed_body_is_built() -> None:
    """The attack's shape at the largest n the limit allows (32 MiB: n=32 of a 500-token prompt with
    prompt_logprobs=20, about 22 MB; n=48 is refused): /health stays within 1 s throughout."""
    import httpx

    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app
    from pypto_serving.tokenizer import Tokenizer

    settings = ServingSettings(
        model=str(_tiny_qwen3()),
        device="cpu",
        worker_mode="inproc",
        scheduler="sync",
        engine_mode="thread",
        max_response_bytes=32 * 2**20,
    )
    llm = AsyncLLM(settings, PluginManager())
    llm.wait_ready(60)
    live = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    try:
        text = "The quick brown fox jumps over the lazy dog; streaming servers answer every client in turn. " * 40
        prompt = Tokenizer(_tiny_qwen3()).encode(text)[:500]
        body = {"prompt": prompt, "prompt_logprobs": 20, "max_tokens": 1}
        r = httpx.post(f"{live.url}/v1/completions", json=body | {"n": 48}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "response_too_large", r.text[:300]
        worst, size = _health_while(live.url, body | {"n": 32})
        assert size > 16 * 2**20, size  # a body that takes seconds to build
        assert worst < 1.0, f"/health took {worst:.2f}s while a {size / 1e6:.0f} MB body was built"
    finally:
        live.stop()
        llm.shutdown(10)


def _health_while(url: str, body: dict[str, Any]) -> tuple[float, int]:
    """(the slowest /health answer, the body's size) while ``body`` is served."""
    import httpx

    worst = 0.0
    done = threading.Event()

    def probe() -> None:
        nonlocal worst
        with httpx.Client(base_url=url, timeout=30) as h:
            while not done.is_set():
                start = time.perf_counter()
                assert h.get("/health").status_code == 200
                worst = max(worst, time.perf_counter() - start)
                time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    finally:
        done.set()
        prober.join()
    assert r.status_code == 200, r.text[:300]
    return worst, len(r.content)


_JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(), st.text(max_size=5))
_JSON_VALUES = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=600), st.dictionaries(st.text(max_size=4), inner, max_size=5)),
    max_leaves=2000,
)


@settings(max_examples=200, deadline=None)
@given(value=_JSON_VALUES)
def test_a_body_encoded_in_pieces_is_msgspecs_encoding(value: Any) -> None:
    """Large bodies are encoded piece by piece (the event loop runs between msgspec calls); the bytes
    are exactly one msgspec call's, NaN and infinities (null) included."""
    import msgspec

    from pypto_serving.server.responses import encode_pieces

    assert b"".join(encode_pieces(value)) == msgspec.json.encode(value)
