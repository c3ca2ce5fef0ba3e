"""Shared shapes for benchmarks: every figure is reported next to a floor measured in the
same run, as a ratio, with the target it is judged against."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable


@dataclasses.dataclass
class Result:
    """One row of the benchmark table.

    ``value`` and ``floor`` share ``unit``; ``ratio = value / floor``. ``target`` is a
    human string (``"ratio <= 1.5"``); ``passed`` is None for report-only figures.
    """

    figure: str
    value: float
    unit: str
    floor: float | None = None
    target: str = "report"
    passed: bool | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.floor in (None, 0):
            return None
        return self.value / self.floor

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        return d


def ratio_result(figure: str, value: float, floor: float, unit: str, max_ratio: float,
                 note: str = "") -> Result:
    """A row judged by ``value / floor <= max_ratio``."""
    r = Result(figure, value, unit, floor, f"ratio <= {max_ratio}", None, note)
    r.passed = r.ratio is not None and r.ratio <= max_ratio
    return r


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    """Best wall time of ``repeat`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def percentile(samples: list[float], p: float) -> float:
    """p in 0..100, nearest-rank on sorted samples."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(samples: list[float]) -> float:
    return statistics.median(samples) if samples else float("nan")
