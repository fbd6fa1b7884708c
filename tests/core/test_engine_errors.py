"""Offline errors are visible: a failed request carries its error message and logs it once, and
``LLM(settings=..., **overrides)`` validates the overrides."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams, ServingSettings
from pypto_serving.config import SettingsError
from pypto_serving.engine import _output

pytestmark = pytest.mark.requires_plugin("sync_sched")

_FAILURE_LOG = "pypto_serving.engine"


def _failure_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _FAILURE_LOG and " failed: " in r.getMessage()]


@pytest.mark.parametrize("mode", ["inproc", "process"])
def test_failed_step_carries_its_error_and_logs_it_once(
    make_llm: Callable[..., Any], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    llm = make_llm(worker_mode=mode, block_size=4, num_kv_blocks=32, executor_options={"fail_on_token": 5})
    caplog.set_level(logging.ERROR, logger=_FAILURE_LOG)
    params = SamplingParams(max_tokens=4, temperature=0, n=2)
    (bad,) = llm.generate([5, 6, 7], params, use_tqdm=False)
    for c in bad.outputs:
        assert c.finish_reason == "error" and c.text == ""
        assert c.error is not None and "fake executor asked to fail" in c.error
    (good,) = llm.generate([8, 9], params, use_tqdm=False)  # the engine goes on; no error on success
    assert all(c.error is None and c.finish_reason == "length" for c in good.outputs)
    logged = [m for m in _failure_records(caplog) if m.startswith("request ")]
    assert sorted(m.split(" ")[1] for m in logged) == [f"{bad.request_id}-0", f"{bad.request_id}-1"], logged
    assert all("fake executor asked to fail" in m for m in logged)


def test_non_finite_logits_name_the_request_error(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=32, executor_options={"nan_on_token": 94})
    out = llm.generate([3, 94], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error" and out.error is not None and "non-finite" in out.error


def test_the_failure_log_is_not_repeated_by_later_snapshots(
    make_llm: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A finished request's output can be built again (a retry, a debugger); the log line is not."""
    llm = make_llm(block_size=4, num_kv_blocks=32, executor_options={"fail_on_token": 5})
    caplog.set_level(logging.ERROR, logger=_FAILURE_LOG)
    engine = llm.engine
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=2))
    choices = engine._users["r"]
    while engine.has_unfinished():
        engine.step()
    assert _output(choices).finished and _output(choices).outputs[0].error is not None
    assert len([m for m in _failure_records(caplog) if m.startswith("request r ")]) == 1


def test_overrides_of_given_settings_are_validated(fake_pm: Any) -> None:
    settings = ServingSettings(executor="fake", worker_mode="inproc", scheduler="sync")
    with pytest.raises(SettingsError, match="max_num_seqs"):
        LLM(settings=settings, plugins=fake_pm, max_num_seqs=-1)
    with pytest.raises(SettingsError, match="no_such_setting"):
        LLM(settings=settings, plugins=fake_pm, no_such_setting=1)
    with pytest.raises(SettingsError, match="dtype"):
        LLM(settings=settings, plugins=fake_pm, dtype="float8")


def test_valid_overrides_keep_the_given_settings(fake_pm: Any) -> None:
    settings = ServingSettings(executor="fake", worker_mode="inproc", scheduler="sync", block_size=4, num_kv_blocks=64)
    with LLM(settings=settings, plugins=fake_pm, max_num_seqs=3, executor_options={"vocab": 50}) as llm:
        assert llm.settings.max_num_seqs == 3 and llm.settings.block_size == 4
        assert llm.settings.num_kv_blocks == 64 and llm.settings.executor_options == {"vocab": 50}
        assert llm.engine is not None and llm.engine.info.vocab_size == 50
    assert settings.max_num_seqs == 64  # the caller's object is left alone


def test_a_choice_whose_id_is_taken_fails_the_whole_request(make_llm: Callable[..., Any]) -> None:
    """``n = 2`` choices of "a" are "a-0" and "a-1"; with "a-1" already a request, adding "a" fails
    and leaves no orphan "a-0" running unreported."""
    engine = make_llm(block_size=4, num_kv_blocks=32).engine
    engine.add_request("a-1", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [3, 4], SamplingParams(max_tokens=2, n=2))
    assert sorted(engine.scheduler.requests) == ["a-1"]
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["a-1"]
    assert not engine.scheduler.has_unfinished()


def test_lora_settings_need_an_executor_that_applies_adapters(make_llm: Callable[..., Any], tmp_path: Any) -> None:
    """An executor that does not declare ``supports_lora`` would run a request naming an adapter on
    the base model: its LoRA settings are refused at start instead."""
    with pytest.raises(SettingsError, match="lora_modules is set, but the fake executor does not serve LoRA"):
        make_llm(lora_modules=[f"a={tmp_path}"], executor_options={"lora": False})
    with pytest.raises(SettingsError, match="enable_lora is set, but the fake executor does not serve LoRA"):
        make_llm(enable_lora=True, executor_options={"lora": False})
    assert make_llm(executor_options={"lora": False}).engine.loras.enabled is False
