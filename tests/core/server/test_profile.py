"""/start_profile and /stop_profile: admin key only; a profile of a short run with a spawned worker
gives two valid Chrome traces (engine, worker) whose ranges name the step's phases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ADMIN = {"authorization": "Bearer adm1n"}


def _names(trace: Path) -> set[str]:
    data = json.loads(trace.read_text())  # a Chrome trace is JSON: {"traceEvents": [...]}
    events = data["traceEvents"]
    assert isinstance(events, list)
    return {e.get("name", "") for e in events}


def test_a_profile_of_a_short_run_is_a_chrome_trace_with_the_phases(make_client: Any, tmp_path: Path) -> None:
    # A spawned worker: its profile is its own process's, the trace crosses no pipe.
    client, _ = make_client(admin_api_key=["adm1n"], profile_dir=tmp_path, worker_mode="process")
    r = client.post("/start_profile", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert client.post("/start_profile", headers=ADMIN).status_code == 409
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    r = client.post("/stop_profile", headers=ADMIN)
    assert r.status_code == 200, r.text
    engine, worker = (Path(p) for p in r.json()["traces"])
    assert engine.parent == tmp_path and engine.name.endswith(".engine.json")
    assert {"schedule", "apply"} <= _names(engine)
    assert {"launch", "forward", "sample", "finish"} <= _names(worker)
    assert client.post("/stop_profile", headers=ADMIN).status_code == 409


def test_the_profile_routes_take_only_the_admin_key(make_client: Any) -> None:
    client, _ = make_client(api_key=["user"])
    r = client.post("/start_profile", headers={"authorization": "Bearer user"})
    assert r.status_code == 403 and "admin_api_key" in r.json()["error"]["message"]
    client, _ = make_client(api_key=["user"], admin_api_key=["adm1n"])
    assert client.post("/start_profile", headers={"authorization": "Bearer user"}).status_code == 401
    assert client.post("/stop_profile").status_code == 401
    assert client.post("/stop_profile", headers=ADMIN).status_code == 409  # admitted: nothing runs
    assert client.get("/v1/models", headers=ADMIN).status_code == 401  # the admin key is not an API key


def test_an_in_process_worker_shares_the_engines_trace(make_client: Any, tmp_path: Path) -> None:
    client, _ = make_client(admin_api_key=["adm1n"], profile_dir=tmp_path)  # worker_mode inproc
    assert client.post("/start_profile", headers=ADMIN).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}).status_code == 200
    engine, worker = (Path(p) for p in client.post("/stop_profile", headers=ADMIN).json()["traces"])
    assert {"schedule", "apply", "launch", "forward", "sample", "finish"} <= _names(engine) == _names(worker)


def test_an_in_process_engine_trace_appears_only_once_whole(make_client: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """/stop_profile answers once both trace names exist, so the engine's copy of an in-process
    worker's trace is written under another name and renamed: while it is written, its name is absent."""
    import shutil

    from pypto_serving import engine as engine_module

    seen: list[bool] = []
    copy = shutil.copyfile

    def watched(src: str, dst: str) -> str:
        copy(src, dst)
        seen.append(any(p.name.endswith(".engine.json") for p in tmp_path.iterdir()))
        return dst

    monkeypatch.setattr(engine_module.shutil, "copyfile", watched)
    client, _ = make_client(admin_api_key=["adm1n"], profile_dir=tmp_path)
    assert client.post("/start_profile", headers=ADMIN).status_code == 200
    assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    engine, _ = (Path(p) for p in client.post("/stop_profile", headers=ADMIN).json()["traces"])
    assert seen == [False]
    assert "schedule" in _names(engine)
