"""/dashboard: its routes and their auth, the SQLite history (bounded, kept across a restart), and the
page itself in headless Chromium against a live server under load, its charts' data read back and
compared with /metrics."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pypto_serving.server.history import MetricsHistory, series_key, snapshot
from tests.core.server.server_helpers import wait_for


def _fake_snapshot(i: int, rng: random.Random) -> dict[str, float]:
    """A snapshot shaped like the dashboard's (four histograms, counters, gauges), values that vary."""
    values = {
        f'pypto_serving_h{h}_bucket{{le="{le}"}}': float(i * rng.randint(1, 9)) for h in range(4) for le in range(15)
    }
    values.update({f"pypto_serving_c{c}_total": float(i * c + rng.random()) for c in range(12)})
    return values


def test_history_reads_back_thinned_and_forgets_past_the_retention(tmp_path: Path) -> None:
    h = MetricsHistory(tmp_path / "h.sqlite", retention=100.0, max_bytes=1 << 20)
    for t in range(200):
        h.add(1000.0 + t, {"pypto_serving_x_total": float(t)})
    assert h.count() == 101  # t in [1099, 1199]
    rows = h.read(0, 10)
    assert len(rows) == 10 and rows[-1] == (1199.0, {"pypto_serving_x_total": 199.0})
    assert [t for t, _ in rows] == sorted(t for t, _ in rows)
    assert [t for t, _ in h.read(1190.0, 1000)] == [float(t) for t in range(1191, 1200)]
    h.close()


def test_history_file_stays_within_its_bound_under_a_soak(tmp_path: Path) -> None:
    path, bound = tmp_path / "soak.sqlite", 64 * 1024
    h = MetricsHistory(path, retention=1e9, max_bytes=bound)
    rng = random.Random(0)
    largest = 0
    for i in range(1500):
        h.add(float(i), _fake_snapshot(i, rng))
        if i % 50 == 0:
            largest = max(largest, path.stat().st_size)
    largest = max(largest, path.stat().st_size)
    kept = h.read(0, 100_000)
    h.close()
    assert largest <= bound, f"the history file grew to {largest} bytes (bound {bound})"
    assert 20 < len(kept) < 1500  # the oldest went, a useful tail stays
    assert kept[-1][0] == 1499.0  # the newest sample is always kept


def test_history_survives_a_server_restart(make_client: Any, tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    client, _ = make_client(dashboard_history_path=path, dashboard_sample_interval=0.05)
    assert (
        client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 7, "ignore_eos": True}).status_code == 200
    )
    wait_for(
        lambda: _history(client) and _history(client)[-1]["values"].get("pypto_serving_generation_tokens_total") == 7,
        10,
        "a sample after the request",
    )
    client.__exit__(None, None, None)  # the app's lifespan ends: the sampler stops, the file stays
    restarted_at = time.time()
    client2, _ = make_client(dashboard_history_path=path, dashboard_sample_interval=0.05)
    old = [s for s in _history(client2) if s["t"] < restarted_at]
    assert old and old[-1]["values"]["pypto_serving_generation_tokens_total"] == 7
    wait_for(lambda: any(s["t"] > restarted_at for s in _history(client2)), 10, "a sample of the new server")
    new = [s for s in _history(client2) if s["t"] > restarted_at]
    assert new[-1]["values"].get("pypto_serving_generation_tokens_total", 0) == 0  # its own counters


def _history(client: Any, **params: Any) -> list[dict[str, Any]]:
    r = client.get("/dashboard/history", params=params)
    assert r.status_code == 200, r.text
    snapshots: list[dict[str, Any]] = r.json()["snapshots"]
    return snapshots


def test_dashboard_routes(make_client: Any) -> None:
    client, _ = make_client()
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in re.findall(r'(?:src|href)="(/dashboard/static/[^"]+)"', page.text):
        r = client.get(src)
        assert r.status_code == 200 and len(r.content) > 1000, src
    assert "MIT" in client.get("/dashboard/static/uPlot.LICENSE").text
    assert client.get("/dashboard/static/..%2Fhistory.py").status_code == 404
    assert client.get("/dashboard/static/history.py").status_code == 404
    for bad in ({"since": "-1"}, {"points": "0"}, {"points": "100000"}, {"since": "x"}):
        assert client.get("/dashboard/history", params=bad).status_code == 400, bad


def test_dashboard_auth_takes_the_key_from_header_or_cookie(make_client: Any) -> None:
    client, _ = make_client(api_key=["s3cret"])
    login = client.get("/dashboard")
    assert login.status_code == 401 and "<form" in login.text and "s3cret" not in login.text
    assert client.get("/dashboard/history").status_code == 401
    assert client.get("/dashboard/history", headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/dashboard", headers={"cookie": "pypto_serving_key=s3cret"}).text.count("uPlot") >= 1
    assert client.get("/dashboard/history", headers={"cookie": "a=b; pypto_serving_key=s3cret"}).status_code == 200
    assert client.get("/dashboard/history", headers={"cookie": "pypto_serving_key=wrong"}).status_code == 401
    assert client.get("/dashboard/history", headers={"cookie": "pypto_serving_key=%FF%00"}).status_code == 401
    # The cookie opens the dashboard's routes only: an API route still needs the header.
    assert client.get("/v1/models", headers={"cookie": "pypto_serving_key=s3cret"}).status_code == 401


# -- the page in a real browser


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if path is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install chromium) to load /dashboard in")
    return path


def _browser(chromium: str, profile: Path, url: str, *args: str) -> str:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}"]
    r = subprocess.run([*cmd, *args, url], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _metrics_snapshot(url: str) -> dict[str, float]:
    """history.snapshot() of the Prometheus text (parsed by prometheus_client, not by the server)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    samples = [{"name": f.name, "samples": [s._asdict() for s in f.samples]} for f in families]
    return snapshot({"families": samples})


def test_the_page_charts_what_metrics_says(live_server: Any, tmp_path: Path) -> None:
    chromium = _chromium()
    server, _ = live_server(dashboard_sample_interval=0.1, executor_options={"step_sleep": 0.002})
    done = 0

    def load() -> None:
        nonlocal done
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(8):
                c.post("/v1/completions", json={"prompt": [4, 5, 6 + i], "max_tokens": 12, "ignore_eos": True})
                done += 1

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert done == 24
    time.sleep(0.3)  # history samples of the idle server after the load
    dom = _browser(
        chromium, tmp_path / "profile", server.url + "/dashboard", "--virtual-time-budget=5000", "--dump-dom"
    )
    found = re.search(r'<script id="dashboard-data" type="application/json">(.*?)</script>', dom, re.S)
    assert found, dom[-2000:]
    data = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert data["history_snapshots"] >= 3 and data["snapshots"] > data["history_snapshots"]
    latest = data["latest"]["values"]
    assert latest == _metrics_snapshot(server.url)  # the idle server: the page's last poll is /metrics now
    assert latest["pypto_serving_generation_tokens_total"] == 24 * 12
    charts = data["charts"]
    assert charts["requests"]["y"][0][-1] == 0 and charts["requests"]["y"][1][-1] == 0
    tokens = charts["tokens"]
    assert tokens["labels"] == ["output", "prompt"]
    # Each point is the rate between two snapshots: their sum times the intervals is the count.
    xs, rates = tokens["x"], tokens["y"][0]
    assert all(r is not None and r >= 0 for r in rates)
    assert {"ttft", "tpot", "itl", "kv", "prefix", "spec", "restarts"} <= set(charts)
    ttft = charts["ttft"]["y"]
    seen = [(p50, p99) for p50, p99 in zip(ttft[0], ttft[2]) if p50 is not None]
    assert all(0 < p50 <= p99 for p50, p99 in seen)
    assert charts["restarts"]["y"][0][-1] == 0
    assert len(xs) == len(rates)
    if os.environ.get("PYPTO_DASHBOARD_SCREENSHOT"):
        _browser(
            chromium,
            tmp_path / "profile",
            server.url + "/dashboard",
            "--virtual-time-budget=5000",
            "--window-size=1440,1100",
            "--hide-scrollbars",
            f"--screenshot={os.environ['PYPTO_DASHBOARD_SCREENSHOT']}",
        )


def test_series_keys_are_the_prometheus_texts() -> None:
    assert series_key("a_total", {"model_name": "m"}) == "a_total"
    assert series_key("h_bucket", {"model_name": "m", "le": "0.5", "b": "x"}) == 'h_bucket{b="x",le="0.5"}'


def test_an_unreadable_history_file_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    path.write_bytes(b"not a database" * 100)
    h = MetricsHistory(path, retention=10.0, max_bytes=1 << 20)
    h.add(1.0, {"a": 1.0})
    assert h.read(0, 10) == [(1.0, {"a": 1.0})]
    h.close()
    assert (tmp_path / "h.sqlite.unreadable").read_bytes().startswith(b"not a database")


def test_the_page_and_the_history_keep_the_same_families() -> None:
    from pypto_serving.server.dashboard import static_file
    from pypto_serving.server.history import DASHBOARD_FAMILIES

    js = static_file("dashboard.js").decode()
    block = re.search(r"const FAMILIES = new Set\(\[(.*?)\]\);", js, re.S)
    assert block is not None
    assert set(re.findall(r'"([a-z0-9_]+)"', block.group(1))) == DASHBOARD_FAMILIES
