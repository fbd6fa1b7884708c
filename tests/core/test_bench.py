"""``pypto-serving bench``: the statistics against hand-computed values, the seeded workload, and both
benchmarks end to end on the fake executor (throughput through ``LLM``, serve against a live uvicorn)
plus the CLI path on a tiny real Qwen3 where that plugin is installed."""

from __future__ import annotations

import io
import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pypto_serving.bench import make_prompts, percentile, summarize
from pypto_serving.bench.progress import Progress
from pypto_serving.bench.serve import RequestRecord, ServeConfig, arrival_delays, serve_figures
from pypto_serving.cli import main
from tests.core.server.server_helpers import free_port, write_fake_model

VOCAB = 320


# ---------------------------------------------------------------- statistics
def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, positions (n - 1) * q / 100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5  # between 2 and 3
    assert percentile(values, 99) == pytest.approx(3.97)  # position 2.97: 3 + 0.97 * (4 - 3)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 101)


def test_summarize_scales_and_reports_mean_p50_p99() -> None:
    s = summarize([0.010, 0.020, 0.030, 0.040, 0.100], scale=1000)
    assert s["mean"] == pytest.approx(40.0)
    assert s["p50"] == pytest.approx(30.0)
    assert s["p99"] == pytest.approx(40 + 0.96 * 60)  # position 3.96
    assert (s["min"], s["max"]) == pytest.approx((10.0, 100.0))
    assert all(math.isnan(v) for v in summarize([]).values())


def test_tpot_excludes_the_first_token() -> None:
    rec = RequestRecord(output_tokens=5, ttft=0.1, e2e=0.5)
    assert rec.tpot == pytest.approx(0.1)  # (0.5 - 0.1) / 4
    assert RequestRecord(output_tokens=1, ttft=0.1, e2e=0.1).tpot is None


def test_serve_figures_count_only_finished_requests() -> None:
    config = ServeConfig(base_url="http://x", prompts=[[1], [2], [3]], max_tokens=3, concurrency=2)
    ok = [
        RequestRecord(prompt_tokens=4, output_tokens=3, ttft=0.1, e2e=0.3, chunk_gaps=[0.1, 0.1]),
        RequestRecord(prompt_tokens=6, output_tokens=3, ttft=0.3, e2e=0.7, chunk_gaps=[0.2, 0.2]),
    ]
    fig = serve_figures(config, [*ok, RequestRecord(error="HTTP 500: boom")], duration=2.0)
    assert (fig["completed"], fig["failed"], fig["errors"]) == (2, 1, ["HTTP 500: boom"])
    assert (fig["output_tokens"], fig["prompt_tokens"]) == (6, 10)
    assert fig["output_tok_s"] == pytest.approx(3.0)
    assert fig["total_tok_s"] == pytest.approx(8.0)
    assert fig["requests_per_s"] == pytest.approx(1.0)
    assert fig["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert fig["tpot_ms"]["mean"] == pytest.approx((100.0 + 200.0) / 2)
    assert fig["itl_ms"]["p50"] == pytest.approx(150.0)
    assert fig["e2e_ms"]["p99"] == pytest.approx(300 + 0.99 * 400)


# ---------------------------------------------------------------- workload
def test_workload_is_seeded_and_within_bounds() -> None:
    a = make_prompts(50, 3, 9, vocab_size=11, seed=7)
    assert a == make_prompts(50, 3, 9, vocab_size=11, seed=7)
    assert a != make_prompts(50, 3, 9, vocab_size=11, seed=8)
    assert all(3 <= len(p) <= 9 for p in a)
    assert {len(p) for p in a} == set(range(3, 10))  # 50 draws reach every length
    assert all(0 <= t < 11 for p in a for t in p)
    # Pinned: the generator is the stdlib's Mersenne Twister, the same in every peer's environment.
    assert make_prompts(1, 4, 4, vocab_size=1000, seed=0) == [[776, 911, 430, 41]]
    with pytest.raises(ValueError, match="prompt lengths"):
        make_prompts(1, 5, 4, vocab_size=10)


def test_poisson_arrivals_are_seeded_with_the_requested_mean() -> None:
    assert arrival_delays(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    gaps = arrival_delays(4000, rate=20.0, seed=1)
    assert gaps == arrival_delays(4000, rate=20.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)


def test_progress_writes_quarters_off_a_terminal() -> None:
    out = io.StringIO()
    p = Progress("bench", 8, stream=out)
    for _ in range(8):
        p.advance()
    p.close()
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"bench: {n}/8 requests" for n in (2, 4, 6, 8)]


def test_bench_commands_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("throughput", "serve"):
        with pytest.raises(SystemExit) as e:
            main(["bench", command, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for flag in ("--num-prompts", "--input-len", "--max-tokens", "--ignore-eos", "--json", "--max-num-seqs"):
            assert flag in text


# ---------------------------------------------------------------- end to end (fake executor)
def _fake_settings(model_dir: Path, **overrides: Any) -> Any:
    from pypto_serving import ServingSettings

    values: dict[str, Any] = dict(
        model=str(model_dir),
        executor="fake",
        worker_mode="inproc",
        scheduler="sync",
        block_size=4,
        num_kv_blocks=256,
        executor_options={"vocab": VOCAB, "max_model_len": 128},
    )
    values.update(overrides)
    return ServingSettings(**values)


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_model(tmp_path_factory.mktemp("bench_model") / "tiny-fake", VOCAB)


def _fake_plugins() -> Any:
    from pypto_serving import PluginManager
    from tests.fakes import FakePlugin

    return PluginManager(extra_plugins=[FakePlugin])


def test_throughput_counts_every_token(fake_model: Path) -> None:
    pytest.importorskip("pypto_serving_sync_sched")
    from pypto_serving.bench import ThroughputConfig, run_throughput

    config = ThroughputConfig(num_prompts=6, min_len=3, max_len=12, max_tokens=5, ignore_eos=True)
    # One forward a command (the CPU's auto runs several), so each of the 5 tokens takes a step.
    settings = _fake_settings(fake_model, num_scheduler_steps=1)
    fig = run_throughput(settings, config, plugins=_fake_plugins(), keep_outputs=True)
    prompts = make_prompts(6, 3, 12, VOCAB, seed=0)  # the tokenizer's vocabulary is the fake model's
    assert fig["num_requests"] == 6
    assert fig["prompt_tokens"] == sum(len(p) for p in prompts)
    assert fig["output_tokens"] == 6 * 5 == sum(len(o) for o in fig["outputs"])
    assert fig["wall_s"] > 0
    assert fig["requests_per_s"] == pytest.approx(6 / fig["wall_s"])
    assert fig["output_tok_s"] == pytest.approx(30 / fig["wall_s"])
    assert fig["total_tok_s"] == pytest.approx((30 + fig["prompt_tokens"]) / fig["wall_s"])
    assert fig["scheduler"] == "sync" and fig["num_steps"] >= 5


def test_throughput_reports_speculation(fake_model: Path) -> None:
    pytest.importorskip("pypto_serving_sync_sched")
    from pypto_serving.bench import ThroughputConfig, run_throughput

    settings = _fake_settings(
        fake_model,
        speculative_config={"method": "fake", "num_speculative_tokens": 2, "policy": "fixed"},
        executor_options={"vocab": VOCAB, "max_model_len": 128, "max_draft": 2, "draft_error_rate": 0.4},
    )
    config = ThroughputConfig(num_prompts=4, min_len=3, max_len=8, max_tokens=12, ignore_eos=True)
    fig = run_throughput(settings, config, plugins=_fake_plugins())
    assert (fig["spec_method"], fig["spec_policy"], fig["spec_k"]) == ("fake", "fixed", 2)
    assert 0 < fig["spec_accepted"] < fig["spec_drafted"]
    assert sum(fig["spec_accepted_per_pos"]) == fig["spec_accepted"]
    assert fig["spec_acceptance_rate"] == pytest.approx(fig["spec_accepted"] / fig["spec_drafted"])
    assert fig["spec_mean_accepted_length"] == pytest.approx(fig["spec_accepted"] / fig["spec_verify_steps"])


class _LiveServer:
    """The app on uvicorn in a thread (as the server tests' live_server fixture does)."""

    def __init__(self, model_dir: Path, **overrides: Any) -> None:
        import uvicorn

        from pypto_serving.server import AsyncLLM, build_app

        self.llm = AsyncLLM(_fake_settings(model_dir, **overrides), _fake_plugins())
        self.llm.wait_ready(60)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(build_app(self.llm, manage_engine=False), host="127.0.0.1", port=port)
        config.log_level = "warning"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.llm.shutdown(10)


@pytest.fixture(scope="module")
def live_url(fake_model: Path) -> Iterator[str]:
    pytest.importorskip("pypto_serving_sync_sched")
    pytest.importorskip("httpx")
    server = _LiveServer(fake_model)
    yield server.url
    server.stop()


@pytest.mark.parametrize("mode", [{"concurrency": 3}, {"request_rate": 200.0}])
def test_serve_latencies_are_consistent(live_url: str, mode: dict[str, Any]) -> None:
    from pypto_serving.bench import run_serve

    prompts: list[list[int] | str] = list(make_prompts(8, 2, 10, VOCAB, seed=3))
    fig = run_serve(ServeConfig(base_url=live_url, prompts=prompts, max_tokens=6, logprobs=True, **mode))
    assert (fig["completed"], fig["failed"]) == (8, 0), fig["errors"]
    assert fig["output_tokens"] == 8 * 6
    assert fig["prompt_tokens"] == sum(len(p) for p in prompts)
    for stat in ("mean", "p50", "p99"):
        assert 0 < fig["ttft_ms"][stat] <= fig["e2e_ms"][stat]
        assert fig["tpot_ms"][stat] >= 0 and fig["itl_ms"][stat] >= 0
    assert fig["e2e_ms"]["max"] <= fig["duration_s"] * 1000
    assert fig["output_tok_s"] == pytest.approx(48 / fig["duration_s"])


def test_serve_command_against_a_running_server(live_url: str, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", live_url, "--vocab-size", str(VOCAB), "--num-prompts", "4"]
    argv += ["--input-len", "2", "6", "--max-tokens", "4", "--ignore-eos", "--concurrency", "2", "--json", str(out)]
    assert main(argv) == 0
    fig = json.loads(out.read_text())
    assert (fig["completed"], fig["output_tokens"]) == (4, 16)
    assert fig["ttft_ms"]["p50"] <= fig["e2e_ms"]["p50"]
    assert "ttft_ms p99" in capsys.readouterr().out


def test_serve_command_wraps_the_run_in_a_profile(fake_model: Path, tmp_path: Path) -> None:
    pytest.importorskip("pypto_serving_sync_sched")
    server = _LiveServer(fake_model, admin_api_key=["adm"], profile_dir=tmp_path / "traces")
    try:
        out = tmp_path / "serve.json"
        argv = ["bench", "serve", "--base-url", server.url, "--vocab-size", str(VOCAB), "--num-prompts", "2"]
        argv += ["--input-len", "2", "4", "--max-tokens", "3", "--json", str(out), "--profile", "--profile-key", "adm"]
        assert main(argv) == 0
        traces = [Path(p) for p in json.loads(out.read_text())["profile_traces"]]
        assert [p.parent for p in traces] == [tmp_path / "traces"] * 2
        assert "forward" in {e.get("name") for e in json.loads(traces[1].read_text())["traceEvents"]}
        with pytest.raises(SystemExit, match="401"):
            main([*argv[:-1], "wrong"])
    finally:
        server.stop()


def test_serve_reports_failed_requests(live_url: str) -> None:
    from pypto_serving.bench import run_serve

    config = ServeConfig(base_url=live_url, prompts=[[1, 2]], max_tokens=2, model_name="no-such-model", warmup=False)
    fig = run_serve(config)
    assert (fig["completed"], fig["failed"]) == (0, 1)
    assert fig["errors"][0].startswith("HTTP 404")


# ---------------------------------------------------------------- CLI on a real tiny Qwen3
@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    return make_qwen_checkpoint(tmp_path_factory.mktemp("bench_qwen") / "qwen3", "qwen3", num_hidden_layers=2)


@pytest.mark.requires_plugin("qwen", "sync_sched")
def test_throughput_command_on_a_tiny_qwen(tiny_qwen: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", str(tiny_qwen), "--num-prompts", "5", "--input-len", "4", "16"]
    argv += ["--max-tokens", "7", "--ignore-eos", "--scheduler", "sync", "--worker-mode", "inproc", "--json", str(out)]
    assert main(argv) == 0
    fig = json.loads(out.read_text())
    assert (fig["num_requests"], fig["output_tokens"], fig["scheduler"]) == (5, 35, "sync")
    assert fig["prompt_tokens"] == sum(len(p) for p in make_prompts(5, 4, 16, 320, seed=0))
    assert fig["output_tok_s"] > 0 and fig["total_tok_s"] > fig["output_tok_s"]
    table = capsys.readouterr().out
    assert "output_tok_s" in table and "requests_per_s" in table


def test_started_server_gets_the_settings_flags_a_free_port_and_quiet_logs() -> None:
    from pypto_serving.bench.launch import serve_command
    from pypto_serving.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", "--model", "m", "--max-num-seqs", "8", "--dtype", "float32"])
    cmd = serve_command(args)
    assert cmd[1:4] == ["-m", "pypto_serving.cli", "serve"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {
        "--model": "m",
        "--max-num-seqs": "8",
        "--dtype": "float32",
        "--port": "0",
        "--log-level": "warning",
    }
    args = build_parser().parse_args(["bench", "serve", "--model", "m", "--port", "8123", "--log-level", "info"])
    assert dict(zip(serve_command(args)[4::2], serve_command(args)[5::2]))["--port"] == "8123"


@pytest.mark.requires_plugin("qwen", "sync_sched")
def test_serve_command_starts_and_stops_its_own_server(tiny_qwen: Path, tmp_path: Path) -> None:
    pytest.importorskip("httpx")
    out = tmp_path / "s.json"
    argv = ["bench", "serve", "--model", str(tiny_qwen), "--num-prompts", "3", "--input-len", "3", "8"]
    argv += ["--max-tokens", "4", "--ignore-eos", "--logprobs", "--scheduler", "sync", "--worker-threads", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    fig = json.loads(out.read_text())
    assert (fig["completed"], fig["output_tokens"]) == (3, 12)
    assert fig["ttft_ms"]["max"] <= fig["e2e_ms"]["max"]
    assert fig["base_url"].startswith("http://127.0.0.1:")


# ---------------------------------------------------------------- bench serve --model NAME
@pytest.fixture
def named_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Two named models the bench command resolves (``sized``: config.json says its vocabulary;
    ``unsized``: nothing does), and the server start and the client run recorded instead of done."""
    from pypto_serving import ModelSpec, PluginManager, hookimpl

    dirs = {"sized": tmp_path / "sized", "unsized": tmp_path / "unsized"}
    for name, path in dirs.items():
        path.mkdir()
        config = {"architectures": ["FakeForCausalLM"], **({"vocab_size": 50} if name == "sized" else {})}
        (path / "config.json").write_text(json.dumps(config))

    class ShipsModels:
        @staticmethod
        @hookimpl
        def pypto_serving_register_models() -> list[ModelSpec]:
            return [ModelSpec(name, str(path)) for name, path in dirs.items()]

    monkeypatch.setattr("pypto_serving.bench.cli.PluginManager", lambda: PluginManager(extra_plugins=[ShipsModels]))
    return dirs


def _record_bench_serve(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What ``bench serve`` did, in order: ``"started"`` for the server, then the client's config."""
    import contextlib

    events: list[Any] = []

    @contextlib.contextmanager
    def started_server(args: Any) -> Iterator[str]:
        events.append("started")
        yield "http://127.0.0.1:1"

    def run_serve(config: ServeConfig) -> dict[str, Any]:
        events.append(config)
        return serve_figures(config, [], 1.0)

    monkeypatch.setattr("pypto_serving.bench.launch.started_server", started_server)
    monkeypatch.setattr("pypto_serving.bench.serve.run_serve", run_serve)
    return events


@pytest.mark.usefixtures("named_models")
def test_serve_draws_the_workload_from_a_named_models_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _record_bench_serve(monkeypatch)
    assert main(["bench", "serve", "--model", "sized", "--num-prompts", "40", "--input-len", "4", "8"]) == 0
    started, config = events
    assert started == "started"
    assert len(config.prompts) == 40 and {len(p) for p in config.prompts} <= set(range(4, 9))
    ids = {t for p in config.prompts for t in p}
    assert max(ids) < 50 and len(ids) > 40  # the named model's vocabulary, not a default or another one


@pytest.mark.usefixtures("named_models")
@pytest.mark.parametrize(
    ("model", "error"),
    [
        ("unsized", "cannot tell the vocabulary size of "),
        ("size", "model 'size' does not exist: it is neither a directory nor a named model; did you mean 'sized'?"),
    ],
)
def test_serve_fails_before_starting_a_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], model: str, error: str
) -> None:
    events = _record_bench_serve(monkeypatch)
    assert main(["bench", "serve", "--model", model, "--num-prompts", "2"]) == 2
    assert events == []  # no server was started only to be stopped again
    assert error in capsys.readouterr().err


def test_httpx_comes_with_the_core() -> None:
    """``bench serve``'s client is a dependency of the core, not only of its tests."""
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "httpx" for dep in project["dependencies"])
