"""Summary statistics of latency samples: mean and linearly interpolated percentiles (numpy's
default method), so p50 of an even count is the mean of the two middle values."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "summarize"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks; NaN if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is not in [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """``{"mean", "p50", "p99", "min", "max"}`` of ``values`` times ``scale`` (e.g. 1000 for s -> ms)."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan, "min": math.nan, "max": math.nan}
    scaled = [v * scale for v in values]
    return {
        "mean": sum(scaled) / len(scaled),
        "p50": percentile(scaled, 50),
        "p99": percentile(scaled, 99),
        "min": min(scaled),
        "max": max(scaled),
    }
