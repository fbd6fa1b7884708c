"""ServingSettings precedence, error messages and ``pypto-serving config show``."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from pypto_serving.cli import main
from pypto_serving.config import ServingSettings, SettingsError

WriteFile = Callable[[str, str], Path]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PYPTO_SERVING_"):
            monkeypatch.delenv(name)


@pytest.fixture
def write(tmp_path: Path) -> WriteFile:
    def make(name: str, text: str) -> Path:
        p = tmp_path / name
        p.write_text(text)
        return p

    return make


def test_defaults() -> None:
    s = ServingSettings.load()
    assert s.max_num_seqs == 64 and s.source_of("max_num_seqs") == "default"


@pytest.mark.parametrize(("name", "text"), [("c.toml", "max_num_seqs = 3\n"), ("c.yaml", "max_num_seqs: 3\n")])
def test_file_over_defaults(write: WriteFile, name: str, text: str) -> None:
    path = write(name, text)
    s = ServingSettings.load(config_file=path)
    assert s.max_num_seqs == 3
    assert s.source_of("max_num_seqs") == f"config file {path}"
    assert s.source_of("block_size") == "default"


def test_full_precedence(write: WriteFile, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write("c.toml", "max_num_seqs = 3\nblock_size = 32\nmax_num_batched_tokens = 100\n")
    monkeypatch.setenv("PYPTO_SERVING_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("PYPTO_SERVING_BLOCK_SIZE", "8")
    s = ServingSettings.load(config_file=path, block_size=4)
    assert (s.block_size, s.max_num_seqs, s.max_num_batched_tokens, s.num_kv_blocks) == (4, 5, 100, None)
    assert s.source_of("block_size") == "explicit argument"
    assert s.source_of("max_num_seqs") == "environment"
    assert s.source_of("max_num_batched_tokens") == f"config file {path}"
    assert s.source_of("num_kv_blocks") == "default"


def test_config_file_named_by_env(write: WriteFile, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write("c.yaml", "max_num_seqs: 9\n")
    monkeypatch.setenv("PYPTO_SERVING_CONFIG_FILE", str(path))
    assert ServingSettings.load().max_num_seqs == 9


def test_nested_env(write: WriteFile, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write("c.toml", '[speculative_config]\nmethod = "fake"\nnum_speculative_tokens = 2\n')
    assert ServingSettings.load(config_file=path).speculative_config.num_speculative_tokens == 2  # type: ignore[union-attr]
    monkeypatch.setenv("PYPTO_SERVING_SPECULATIVE_CONFIG__NUM_SPECULATIVE_TOKENS", "3")
    spec = ServingSettings.load().speculative_config
    assert spec is not None and spec.num_speculative_tokens == 3
    explicit = ServingSettings.load(speculative_config={"method": "fake", "num_speculative_tokens": 4})
    assert explicit.speculative_config is not None and explicit.speculative_config.num_speculative_tokens == 4


def test_env_json_and_bools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPTO_SERVING_EXECUTOR_OPTIONS", '{"eos": 3}')
    monkeypatch.setenv("PYPTO_SERVING_API_KEY", '["a", "b"]')
    monkeypatch.setenv("PYPTO_SERVING_ENABLE_PREFIX_CACHING", "false")
    s = ServingSettings.load()
    assert s.executor_options == {"eos": 3} and s.api_key == ["a", "b"] and s.enable_prefix_caching is False


def test_env_comma_separated_api_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPTO_SERVING_API_KEY", "a,b")
    assert ServingSettings.load().api_key == ["a", "b"]


def test_invalid_in_file_names_field_value_source_and_rule(write: WriteFile) -> None:
    path = write("c.toml", "max_num_seqs = 0\n")
    with pytest.raises(SettingsError) as e:
        ServingSettings.load(config_file=path)
    msg = str(e.value)
    assert "max_num_seqs=0" in msg and f"config file {path}" in msg and "greater than 0" in msg


def test_invalid_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPTO_SERVING_MAX_NUM_SEQS", "abc")
    with pytest.raises(SettingsError) as e:
        ServingSettings.load()
    msg = str(e.value)
    assert "max_num_seqs='abc'" in msg and "environment variable PYPTO_SERVING_MAX_NUM_SEQS" in msg
    assert "valid integer" in msg


def test_invalid_argument() -> None:
    with pytest.raises(SettingsError) as e:
        ServingSettings.load(worker_mode="threads")
    msg = str(e.value)
    assert "worker_mode='threads'" in msg and "explicit argument" in msg and "'process' or 'inproc'" in msg


def test_invalid_nested_env_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPTO_SERVING_SPECULATIVE_CONFIG__NUM_SPECULATIVE_TOKENS", "99")
    with pytest.raises(SettingsError) as e:
        ServingSettings.load()
    msg = str(e.value)
    assert "num_speculative_tokens='99'" in msg and "less than or equal to 8" in msg
    assert "environment variable PYPTO_SERVING_SPECULATIVE_CONFIG" in msg


def test_invalid_nested_env_names_the_exact_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPTO_SERVING_SPECULATIVE_CONFIG__NUM_SPECULATIVE_TOKENS", "99")
    with pytest.raises(SettingsError, match="PYPTO_SERVING_SPECULATIVE_CONFIG__NUM_SPECULATIVE_TOKENS"):
        ServingSettings.load()


def test_unknown_key_in_file(write: WriteFile) -> None:
    path = write("c.yaml", "max_num_seqs: 2\nmax_num_sequences: 3\n")
    with pytest.raises(SettingsError, match=r"unknown setting\(s\) max_num_sequences") as e:
        ServingSettings.load(config_file=path)
    assert str(path) in str(e.value)


def test_unknown_argument() -> None:
    with pytest.raises(SettingsError, match="unknown setting"):
        ServingSettings.load(no_such_setting=1)


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("c.json", "{}", "use a .toml, .yaml or .yml"),
        ("c.toml", "x = [", "is not valid"),
        ("c.yaml", "- 1\n", "table"),
    ],
)
def test_bad_files(write: WriteFile, name: str, text: str, match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        ServingSettings.load(config_file=write(name, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        ServingSettings.load(config_file=tmp_path / "nope.toml")


def test_config_show_lists_sources(
    write: WriteFile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write("c.toml", "max_num_seqs = 3\nblock_size = 32\nport = 9000\n")
    monkeypatch.setenv("PYPTO_SERVING_BLOCK_SIZE", "8")
    assert main(["config", "show", "--config", str(path), "--port", "7000"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["port"].split()[1] == "7000" and lines["port"].endswith("(command-line flag)")
    assert lines["block_size"].split()[1] == "8" and lines["block_size"].endswith("(environment)")
    assert lines["max_num_seqs"].split()[1] == "3" and lines["max_num_seqs"].endswith(f"(config file {path})")
    assert lines["max_model_len"].endswith("(default)")


def test_config_show_json(write: WriteFile, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--json", "--speculative-config", '{"method": "fake"}']) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["speculative_config"] == {
        "value": {
            "method": "fake",
            "num_speculative_tokens": 1,
            "policy": "adaptive",
            "prompt_lookup_min": None,
            "prompt_lookup_max": None,
        },
        "source": "command-line flag",
    }
    assert data["max_num_seqs"] == {"value": 64, "source": "default"}


def test_config_show_reports_invalid_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert "max_num_seqs='0'" in err and "command-line flag" in err


def test_config_help_lists_every_setting_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    from pypto_serving.cli import main

    with pytest.raises(SystemExit) as e:
        main(["config", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name, field in ServingSettings.model_fields.items():
        assert f"{name} {' '.join((field.description or '').split())}" in out, name


def test_a_bad_api_key_is_refused_without_echoing_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """One blank key among valid ones stops start-up; the error names the entry, never the keys."""
    monkeypatch.setenv("PYPTO_SERVING_API_KEY", '["sk-valid-secret", " "]')
    with pytest.raises(SettingsError) as e:
        ServingSettings.load()
    assert "api_key entry 1" in str(e.value) and "sk-valid-secret" not in str(e.value)


def _speculative_config_rows() -> dict[str, list[str]]:
    """docs/configuration.md's table of how each source writes speculative_config: source -> its snippets."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = doc[doc.index("Each source writes `speculative_config` its own way:") :].split("\n\n")[1]
    rows = [line.split(" | ", 1) for line in table.splitlines()[2:]]
    return {source.strip("| "): re.findall(r"`([^`]+)`", how) for source, how in rows}


def test_every_source_takes_speculative_config_as_the_docs_write_it(
    write: WriteFile, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _speculative_config_rows()
    assert set(rows) == {"flag", "environment", "TOML file", "YAML file", "Python"}
    want = {"method": "mtp", "num_speculative_tokens": 2}
    flag = shlex.split(rows["flag"][0])
    assert main(["config", "show", "--json", *flag]) == 0
    assert json.loads(capsys.readouterr().out)["speculative_config"]["value"].items() >= want.items()
    for variable in rows["environment"]:
        name, value = variable.split("=", 1)
        monkeypatch.setenv(name, shlex.split(value)[0])
        got = ServingSettings.load().speculative_config
        assert got is not None and got.num_speculative_tokens == 2
        monkeypatch.delenv(name)
    for source, suffix in (("TOML file", ".toml"), ("YAML file", ".yaml")):
        got = ServingSettings.load(write("s" + suffix, rows[source][0] + "\n")).speculative_config
        assert got is not None and got.model_dump().items() >= want.items(), source


def test_the_flags_help_says_json_and_the_file_form() -> None:
    description = ServingSettings.model_fields["speculative_config"].description or ""
    assert '{"method": "mtp", "num_speculative_tokens": 2}' in description
    assert "JSON on the command line" in description and "inline table in a TOML file" in description


# -- the KV block size follows the device unless it is set


@pytest.fixture
def host_kind(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Makes ``device = "auto"`` resolve to the given kind, as on a host with that device."""
    from pypto_serving import devices

    return lambda kind: monkeypatch.setattr(devices, "auto_device_kind", lambda: kind)


@pytest.mark.parametrize(
    ("device", "host", "block"),
    [
        ("cuda", "cpu", 256),
        ("cuda:1", "cpu", 256),
        ("npu", "cpu", 128),
        ("cpu", "cuda", 16),
        ("auto", "cuda", 256),
        ("auto", "npu", 128),
        ("auto", "cpu", 16),
    ],
)
def test_an_unset_block_size_is_the_devices_default(
    host_kind: Callable[[str], None], device: str, host: str, block: int
) -> None:
    host_kind(host)
    s = ServingSettings.load(device=device)
    assert s.block_size == block and s.source_of("block_size") == "default"


def test_a_set_block_size_is_honoured_and_a_device_change_moves_only_the_default(
    host_kind: Callable[[str], None], write: WriteFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_kind("cpu")
    default = ServingSettings.load()
    assert default.block_size == 16
    assert default.with_overrides(device="cuda").block_size == 256  # still unset: follows the new device
    assert ServingSettings.load(device="cuda", block_size=16).block_size == 16
    assert ServingSettings.load(block_size=16).with_overrides(device="npu").block_size == 16
    assert ServingSettings.load(config_file=write("c.toml", "device = 'cuda'\nblock_size = 32\n")).block_size == 32
    monkeypatch.setenv("PYPTO_SERVING_BLOCK_SIZE", "64")
    assert ServingSettings.load(device="cuda").block_size == 64
    with pytest.raises(SettingsError, match="block_size=0"):
        ServingSettings.load(block_size=0)


def test_the_engine_start_logs_the_block_size_and_warns_when_one_set_turns_off_fused_attention(
    host_kind: Callable[[str], None], caplog: pytest.LogCaptureFixture
) -> None:
    from pypto_serving import PluginManager

    host_kind("cpu")
    pm = PluginManager(load_entry_points=False)
    cases = [
        ({"device": "cuda"}, "INFO", "block_size 256: the default on cuda"),
        ({"device": "npu:0"}, "INFO", "block_size 128: the default on npu"),
        ({"device": "cuda", "block_size": 512}, "INFO", "block_size 512 on cuda (set; the default there is 256)"),
        ({"device": "cuda", "block_size": 256}, "INFO", "block_size 256: the default on cuda"),
        ({"device": "cuda", "block_size": 16}, "WARNING", "block_size=16 turns off the fused paged attention on cuda"),
        (
            {"device": "npu", "block_size": 1024},
            "WARNING",
            "block_size=1024 turns off the fused paged attention on npu",
        ),
        ({"block_size": 7}, "INFO", "block_size 7 on cpu (set; the default there is 16)"),
    ]
    for overrides, level, text in cases:
        caplog.clear()
        with caplog.at_level("INFO", logger="pypto_serving.devices"):
            pm.configure(ServingSettings.load(**overrides))
        assert [(r.levelname, r.getMessage()[: len(text)]) for r in caplog.records] == [(level, text)], overrides
    caplog.clear()
    with caplog.at_level("INFO", logger="pypto_serving.devices"):
        pm.configure(ServingSettings.load(device="cpu"))
    assert not caplog.records  # the CPU's default is the old one: DEBUG, not a line on every start
    caplog.clear()
    pm.configure(ServingSettings.load(device="cuda", block_size=16))
    (warning,) = caplog.records
    assert (
        "needs a multiple of 256" in warning.getMessage()
        and "unset block_size for cuda's default 256" in warning.getMessage()
    )
