"""``pypto-serving`` as a new user meets it, without a model: ``--help`` of generate / serve /
config show (which flags, their defaults and choices), API keys masked by ``config show``, and
the one-line errors of generate. Everything runs in-process through ``main``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from pypto_serving.cli import main
from pypto_serving.config import ServingSettings

# The settings only the HTTP server reads (issue 10); those of them this version has must stay out of generate.
SERVER_ONLY = [
    "served_model_name",
    "host",
    "port",
    "api_key",
    "protect_metrics",
    "max_request_body_bytes",
    "max_waiting_requests",
    "shutdown_timeout",
    "max_worker_restarts",
    "worker_restart_window",
    "engine_mode",
    "engine_cpu_bind",
    "data_parallel_size",
    "data_parallel_routing",
    "tool_call_parser",
    "reasoning_parser",
    "admin_api_key",
    "profile_dir",
    "request_timeline_capacity",
    "otlp_traces_endpoint",
    "dashboard_history_path",
    "dashboard_history_retention",
    "dashboard_history_max_bytes",
    "dashboard_sample_interval",
    "response_store_max_entries",
    "response_store_max_age",
    "response_store_max_bytes",
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


SERVER_ONLY_FLAGS = [_flag(n) for n in ServingSettings.model_fields if n in SERVER_ONLY or n.startswith("http_")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PYPTO_SERVING_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "250")  # one help line per flag, so a flag and its help can be matched


def help_of(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def flag_lines(text: str) -> dict[str, str]:
    """``--flag`` -> its help entry (flag, metavar and help text, joined into one line)."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"^  (--[a-z-]+)\b", line)
        if m:
            flag = m.group(1)
            entries[flag] = line.strip()
        elif flag is not None and line.startswith("   ") and line.strip():
            entries[flag] += " " + line.strip()  # help text argparse put on the next line(s)
        else:
            flag = None
    return entries


def test_generate_help_leaves_out_server_only_settings(capsys: pytest.CaptureFixture[str]) -> None:
    flags = flag_lines(help_of(capsys, "generate"))
    assert {"--host", "--port", "--api-key", "--shutdown-timeout"} <= set(SERVER_ONLY_FLAGS)
    for flag in SERVER_ONLY_FLAGS:
        assert flag not in flags, f"generate --help lists the server-only {flag}"
    for name in ServingSettings.model_fields:
        if name not in ("config_file", "model") and _flag(name) not in SERVER_ONLY_FLAGS:
            assert _flag(name) in flags, f"generate --help lacks {_flag(name)}"
    assert {"--model", "--config", "--max-tokens", "--log-level", "--max-num-seqs", "--device"} <= set(flags)


@pytest.mark.parametrize("command", [("serve",), ("config", "show")])
def test_serve_and_config_show_keep_every_setting(capsys: pytest.CaptureFixture[str], command: tuple[str]) -> None:
    flags = flag_lines(help_of(capsys, *command))
    for name in ServingSettings.model_fields:
        assert name == "config_file" or _flag(name) in flags, f"{' '.join(command)} --help lacks {_flag(name)}"


def test_help_shows_defaults_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    flags = flag_lines(help_of(capsys, "serve"))
    assert "--dtype {auto,float32,bfloat16,float16}" in flags["--dtype"]
    assert "--log-level {debug,info,warning,error}" in flags["--log-level"]
    assert "--worker-mode {process,inproc}" in flags["--worker-mode"]
    assert flags["--max-num-seqs"].endswith("Most requests running in one step. (default: 64)")
    assert flags["--port"].endswith("(default: 8000)")
    assert flags["--host"].endswith("(default: 127.0.0.1)")
    assert flags["--enable-prefix-caching"].endswith("(default: true)")
    assert flags["--kv-cache-memory"].endswith(f"(default: {512 * 1024**2})")
    assert flags["--num-kv-blocks"].endswith("(default: unset)")
    assert flags["--executor-options"].endswith("(default: {})")
    # Every setting with a default shows it; an unset one either says so or its description explains it.
    for name, info in ServingSettings.model_fields.items():
        if name in ("config_file", "model"):
            continue
        line = flags[_flag(name)]
        if info.get_default(call_default_factory=True) is not None:
            assert "(default: " in line, line
        else:
            assert "(default" in line or "unset" in line, line


def test_generate_sampling_flags_have_help_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    flags = flag_lines(help_of(capsys, "generate"))
    expected = {
        "--max-tokens": "(default: 32)",
        "--temperature": "(default: 0.0)",
        "--top-p": "(default: 1.0)",
        "--top-k": "(default: 0)",
        "--seed-sampling": "(default: unset",
    }
    for flag, default in expected.items():
        words = flags[flag].split()
        assert len(words) > 3, f"{flag} has no help text: {flags[flag]!r}"
        assert default in flags[flag], flags[flag]


def test_config_show_masks_api_keys(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["config", "show", "--api-key", "key-one,sekrit-two"]) == 0
    table = capsys.readouterr().out
    assert "key-one" not in table and "sekrit" not in table
    (line,) = [line for line in table.splitlines() if line.startswith("api_key ")]
    assert '["***", "***"]' in line and line.endswith("(command-line flag)")

    monkeypatch.setenv("PYPTO_SERVING_API_KEY", "from-env-key")
    assert main(["config", "show", "--json"]) == 0
    out = capsys.readouterr().out
    assert "from-env-key" not in out
    assert json.loads(out)["api_key"] == {"value": ["***"], "source": "environment"}


def test_config_show_without_keys_shows_an_empty_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["api_key"] == {"value": [], "source": "default"}


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pypto-serving: error: "), captured.err
    assert captured.out == ""
    return lines[0]


@pytest.fixture
def no_named_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the strategy plugins load, so no installed plugin ships a default model."""
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", "sync_sched,async_sched")


@pytest.mark.usefixtures("no_named_models")
def test_generate_without_a_model_says_pass_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hello"]) == 2
    assert "pass --model DIR or a named model" in _one_error_line(capsys)


def test_generate_with_a_missing_input_file_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "prompts.jsonl"
    assert main(["generate", "--input", str(missing), "--model", str(tmp_path)]) == 2
    assert str(missing) in _one_error_line(capsys)


# ---------------------------------------------------------------- bench
def test_bench_throughput_help_leaves_out_server_only_settings(capsys: pytest.CaptureFixture[str]) -> None:
    flags = flag_lines(help_of(capsys, "bench", "throughput"))
    for flag in SERVER_ONLY_FLAGS:
        assert flag not in flags, f"bench throughput --help lists the server-only {flag}"
    for name in ServingSettings.model_fields:
        if name not in ("config_file", "model") and _flag(name) not in SERVER_ONLY_FLAGS:
            assert _flag(name) in flags, f"bench throughput --help lacks {_flag(name)}"
    assert {"--model", "--num-prompts", "--input-len", "--max-tokens", "--ignore-eos", "--json"} <= set(flags)


def test_bench_serve_keeps_every_setting_for_the_server_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    flags = flag_lines(help_of(capsys, "bench", "serve"))
    for name in ServingSettings.model_fields:
        assert name == "config_file" or _flag(name) in flags, f"bench serve --help lacks {_flag(name)}"
    assert {"--base-url", "--concurrency", "--request-rate", "--prompt-format", "--json"} <= set(flags)


@pytest.mark.usefixtures("no_named_models")
def test_bench_throughput_without_a_model_says_pass_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "throughput", "--vocab-size", "10"]) == 2
    assert "pass --model DIR or a named model" in _one_error_line(capsys)


def test_bench_serve_with_nothing_listening_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("httpx")
    from tests.core.server.server_helpers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--vocab-size", "10", "--num-prompts", "1"]) == 2
    assert f"cannot reach {url}" in _one_error_line(capsys)


# ---------------------------------------------------------------- a new user's first commands
def test_version_prints_the_core_its_plugins_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    lines = dict(line.split(" ", 1) for line in capsys.readouterr().out.splitlines())
    assert lines["pypto-serving"] == metadata.version("pypto-serving")
    assert lines["torch"] == metadata.version("torch")
    for ep in metadata.entry_points(group="pypto_serving"):  # every installed plugin's distribution
        assert ep.dist is not None and lines[ep.dist.name] == ep.dist.version


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["generate", "--max-tokes", "5", "Hello"], "usage: pypto-serving generate", "--max-tokens"),
        (["config", "show", "--max-model-lenn=8"], "usage: pypto-serving config show", "--max-model-len"),
        (["bench", "serve", "--concurency", "4"], "usage: pypto-serving bench serve", "--concurrency"),
        (["models", "--jsn"], "usage: pypto-serving models", "--json"),
    ],
)
def test_a_mistyped_flag_shows_its_commands_usage_and_the_closest_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str, hint: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage + " "), err[:200]
    assert f"(did you mean {hint}?)" in err.splitlines()[-1]


def test_an_argument_without_a_close_flag_gets_no_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["models", "--zzzzzz"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "pypto-serving models: error: unrecognized arguments: --zzzzzz"


def test_the_speculative_config_help_example_is_json_that_the_flag_takes(capsys: pytest.CaptureFixture[str]) -> None:
    entry = flag_lines(help_of(capsys, "serve"))["--speculative-config"]
    assert "--speculative-config JSON" in entry
    example = re.search(r"e\.g\. (\{[^}]*\})", entry)
    assert example is not None, entry
    assert main(["config", "show", "--json", "--speculative-config", example.group(1)]) == 0
    shown = json.loads(capsys.readouterr().out)["speculative_config"]
    assert shown["source"] == "command-line flag"
    assert (shown["value"]["method"], shown["value"]["num_speculative_tokens"]) == ("mtp", 2)
