"""The dashboard's history: a snapshot of the metrics every ``dashboard_sample_interval`` seconds, kept
in a SQLite file (stdlib ``sqlite3``) for ``dashboard_history_retention`` seconds and at most
``dashboard_history_max_bytes`` bytes, so a restarted server still shows the hours before it.

A snapshot is the dashboard's series of ``/metrics/json`` as ``{series: value}``, the series written
as the Prometheus text writes them (``name{label="value",...}``, labels sorted, ``model_name`` left
out since one server serves one model): cumulative counters and histogram buckets, and gauges. The
page derives rates and percentiles from consecutive snapshots, so any subset of the snapshots (the
history is thinned to ``points`` for the page) still gives correct averages over longer intervals.

One sampler thread takes each snapshot and writes it (never the event loop); a lock serialises it
with the reads of ``/dashboard/history``, which run in a worker thread.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DASHBOARD_FAMILIES", "MetricsHistory", "Sampler", "snapshot"]

logger = logging.getLogger(__name__)

# The metric families the dashboard charts (without the ``pypto_serving_`` prefix).
DASHBOARD_FAMILIES = frozenset(
    {
        "generation_tokens",
        "prompt_tokens",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_cache_group_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_drafts",
        "spec_decode_num_accepted_tokens_per_pos",
        "spec_decode_config",
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "inter_token_latency_seconds",
        "worker_restarts",
        "num_preemptions",
        "request_success",
    }
)
_PREFIX = "pypto_serving_"


def series_key(name: str, labels: Mapping[str, str]) -> str:
    """``name{a="x",b="y"}`` with the labels sorted and ``model_name`` left out."""
    shown = sorted((k, v) for k, v in labels.items() if k != "model_name")
    if not shown:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in shown) + "}"


def snapshot(metrics_json: Mapping[str, Any]) -> dict[str, float]:
    """The dashboard's series of a ``/metrics/json`` body (``_created`` samples left out)."""
    out: dict[str, float] = {}
    for family in metrics_json["families"]:
        name = family["name"]
        if not name.startswith(_PREFIX) or name[len(_PREFIX) :] not in DASHBOARD_FAMILIES:
            continue
        for s in family["samples"]:
            if s["value"] is not None and not s["name"].endswith("_created"):
                out[series_key(s["name"], s["labels"])] = s["value"]
    return out


class MetricsHistory:
    """Snapshots by time in one SQLite database: ``path``, or in memory when ``path`` is None."""

    def __init__(self, path: Path | None, retention: float, max_bytes: int) -> None:
        self.path, self.retention, self.max_bytes = path, retention, max_bytes
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = _open(path)
        except sqlite3.DatabaseError as e:  # not a database, or one a crash left corrupt: start afresh
            assert path is not None
            logger.warning("dashboard history %s is unreadable (%s); starting a new one", path, e)
            path.replace(path.with_name(path.name + ".unreadable"))
            self._db = _open(path)

    def add(self, t: float, values: Mapping[str, float]) -> None:
        """Store one snapshot taken at unix time ``t``; drop what is past the retention or the size."""
        blob = zlib.compress(json.dumps(values, separators=(",", ":")).encode(), 6)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO samples VALUES (?, ?)", (t, blob))
            self._db.execute("DELETE FROM samples WHERE t < ?", (t - self.retention,))
            self._db.commit()
            self._shrink()

    def _shrink(self) -> None:
        """Delete the oldest eighth of the rows until the database fits ``max_bytes``."""
        while self.size_bytes() > self.max_bytes:
            (rows,) = self._db.execute("SELECT COUNT(*) FROM samples").fetchone()
            if rows <= 1:
                return
            self._db.execute(
                "DELETE FROM samples WHERE t IN (SELECT t FROM samples ORDER BY t LIMIT ?)", (max(1, rows // 8),)
            )
            self._db.commit()

    def size_bytes(self) -> int:
        (pages,) = self._db.execute("PRAGMA page_count").fetchone()
        (page,) = self._db.execute("PRAGMA page_size").fetchone()
        return int(pages) * int(page)

    def read(self, since: float, points: int) -> list[tuple[float, dict[str, float]]]:
        """The snapshots after unix time ``since``, thinned evenly to at most ``points`` (the newest kept)."""
        with self._lock:
            rows = self._db.execute("SELECT t, data FROM samples WHERE t > ? ORDER BY t", (since,)).fetchall()
        stride = max(1, -(-len(rows) // max(1, points)))
        kept = rows[::-1][::stride][::-1]
        return [(t, json.loads(zlib.decompress(data))) for t, data in kept]

    def count(self) -> int:
        with self._lock:
            (rows,) = self._db.execute("SELECT COUNT(*) FROM samples").fetchone()
        return int(rows)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _open(path: Path | None) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
    try:
        # Set before the table exists: freed pages then leave the file at each commit, so deleting
        # the oldest rows shrinks it (the size bound holds for the file, not only for its contents).
        db.execute("PRAGMA auto_vacuum = FULL")
        # No fsync per sample: a crash of the machine may lose the last samples (or the file, which
        # is then started afresh); a sample every few seconds must not cost a disk flush each.
        db.execute("PRAGMA synchronous = OFF")
        db.execute("CREATE TABLE IF NOT EXISTS samples (t REAL PRIMARY KEY, data BLOB NOT NULL)")
        db.execute("SELECT COUNT(*) FROM samples").fetchone()
        db.commit()
    except BaseException:
        db.close()
        raise
    return db


class Sampler:
    """One thread that stores ``take()`` in ``history`` every ``interval`` seconds until stopped."""

    def __init__(self, history: MetricsHistory, take: Callable[[], Mapping[str, float]], interval: float) -> None:
        self.history, self.take, self.interval = history, take, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pypto-dashboard-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.history.add(time.time(), self.take())
            except Exception:  # a full disk, say: the dashboard loses a point, the server goes on
                logger.exception("dashboard history sample failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.history.close()
