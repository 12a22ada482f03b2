"""One row of ``kv-sidecar bench perf``'s table, apart from :mod:`kvtestbed.bench.perf` so the
benchmarks that add rows (:mod:`kvtestbed.bench.perf_guard`) need not import the runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    """One line of the table. ``met`` is None where the issue sets no target."""

    figure: str
    sidecar: float
    baseline: float
    unit: str
    ratio: float
    target: str
    met: bool | None
    spread: str = ""
