"""The record each surface of ``kv-sidecar bench reliability`` returns, and how it is run.

A *surface* is a part of the sidecar that reads the outside world (files, sockets, peers,
flags). Its bench function feeds it hostile cases and checks every one: a case is
*answered* when the sidecar verified it (the data is what was written, or consistent), or
refused it with a message, or counted it as a drop with its reason; it *escaped* when an
exception left the entry point; it *hung* when it ran past its deadline; it is *lost*
when none of these can be shown. Tracebacks the sidecar logged while the surface ran are
counted too (a logged traceback is a bug the fuzz found, even when it was caught).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SurfaceResult:
    name: str
    tried: str
    cases: int = 0
    answered: int = 0
    escaped: int = 0
    hangs: int = 0
    tracebacks: int = 0
    rss_growth_mb: float = 0.0
    rss_limit_mb: float = 256.0
    figures: dict[str, Any] = field(default_factory=dict)  # surface-specific, each checked
    failed_checks: list[str] = field(default_factory=list)
    min_cases: int = 1

    @property
    def lost(self) -> int:
        return self.cases - self.answered - self.escaped

    def check(self, ok: bool, what: str) -> None:
        """A figure the surface prints must hold: ``what`` names it when it does not."""
        if not ok:
            self.failed_checks.append(what)

    @property
    def ok(self) -> bool:
        return (self.cases >= self.min_cases and self.escaped == 0 and self.lost == 0
                and self.hangs == 0 and self.tracebacks == 0 and not self.failed_checks
                and self.rss_growth_mb <= self.rss_limit_mb)

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "tried": self.tried, "cases": self.cases,
                "answered": self.answered, "escaped": self.escaped, "lost": self.lost,
                "hangs": self.hangs, "tracebacks": self.tracebacks,
                "rss_growth_mb": round(self.rss_growth_mb, 1),
                "rss_limit_mb": self.rss_limit_mb, "min_cases": self.min_cases,
                "figures": self.figures, "failed_checks": self.failed_checks, "ok": self.ok}


Surface = Callable[[bool, int], SurfaceResult]  # (quick, seed) -> result


class TracebackCounter(logging.Handler):
    """Counts records logged with an exception attached (``log.exception``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.first: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.count += 1
            if self.first is None:
                self.first = f"{record.name}: {record.getMessage()[:200]}"


def rss_mb() -> float:
    """Resident memory now (``/proc/self/status`` VmRSS), in MiB; 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_surface(surface: Surface, quick: bool, seed: int) -> SurfaceResult:
    """One surface, with tracebacks counted and memory growth measured; progress on
    stderr (the full run takes minutes)."""
    counter = TracebackCounter()
    root = logging.getLogger("sidecar")
    root.addHandler(counter)
    before = rss_mb()
    started = time.perf_counter()
    name = getattr(surface, "__name__", "surface")
    print(f"bench reliability: {name} ...", file=sys.stderr, flush=True)
    try:
        res = surface(quick, seed)
    finally:
        root.removeHandler(counter)
    res.tracebacks += counter.count
    if counter.first:
        res.figures["first_traceback"] = counter.first
    res.rss_growth_mb = max(res.rss_growth_mb, rss_mb() - before)
    res.figures["seconds"] = round(time.perf_counter() - started, 2)
    print(f"bench reliability: {res.name}: {res.cases} cases, {res.escaped} escaped, "
          f"{res.lost} lost, {res.hangs} hangs ({res.figures['seconds']} s)",
          file=sys.stderr, flush=True)
    return res
