"""The one path from a reported verdict to whatever acts on it, in a stated order.

Every verdict, whichever mode verified it (the hit path's dispatcher, an on-demand
``Monitor.verify``, a scrub tick), is first counted by :class:`sidecar.core.report.VerdictReporter`
(signals, evidence, sampler feedback) and then handed to the listeners here, by stage:

1. :attr:`Stage.SIGNALS` — further counting: an adapter's own series (LMCache's per-tier
   counts), the detection outlook. Signals are complete before anything acts;
2. :attr:`Stage.EXPORT` — readers that ship the verdict (OTLP spans);
3. :attr:`Stage.ACTIONS` — what changes the engine or the scrub: the scrub's queue, the
   circuit breaker, quarantine (in that order: the breaker counts the verdict that trips it
   before its blocks go);
4. :attr:`Stage.EXTRA` — anything a caller appends (``append``: the vLLM prefix-cache reset,
   a demo's printout, a test's recorder), in the order appended.

One error policy for all of them: a listener that raises is counted (``errors``, per
listener in ``errors_by``), logged with its traceback the first time and every 1000th time,
and skipped; the next listener still runs, and nothing reaches the verifier or an engine hook.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

Listener = Callable[[Any], None]  # called with a sidecar.checks.verifier.Verdict


class Stage(enum.IntEnum):
    """When a listener runs relative to the others (see the module docstring)."""

    SIGNALS = 0
    EXPORT = 1
    ACTIONS = 2
    EXTRA = 3


class VerdictListeners:
    """The ordered listeners of one Monitor. ``append``/``extend``/``remove`` keep the list
    idiom (stage :attr:`Stage.EXTRA`); ``add`` names the stage."""

    def __init__(self) -> None:
        self._by_stage: dict[Stage, list[Listener]] = {s: [] for s in Stage}
        self._ordered: tuple[Listener, ...] = ()
        self.errors = 0
        self.errors_by: dict[str, int] = {}

    def add(self, listener: Listener, stage: Stage = Stage.EXTRA) -> None:
        self._by_stage[stage].append(listener)
        self._reorder()

    def append(self, listener: Listener) -> None:
        self.add(listener, Stage.EXTRA)

    def extend(self, listeners: Any) -> None:
        for listener in listeners:
            self.add(listener, Stage.EXTRA)

    def remove(self, listener: Listener) -> None:
        for group in self._by_stage.values():
            if listener in group:
                group.remove(listener)
                self._reorder()
                return
        raise ValueError("not a verdict listener")

    def _reorder(self) -> None:
        self._ordered = tuple(x for s in Stage for x in self._by_stage[s])

    def __iter__(self) -> Iterator[Listener]:
        return iter(self._ordered)

    def __len__(self) -> int:
        return len(self._ordered)

    def __getitem__(self, i: int) -> Listener:
        return self._ordered[i]

    def __contains__(self, listener: object) -> bool:
        return listener in self._ordered

    def notify(self, verdict: Any) -> None:
        """Call every listener in order with ``verdict``; never raises."""
        for listener in self._ordered:
            try:
                listener(verdict)
            except Exception:
                self._failed(listener)

    def _failed(self, listener: Listener) -> None:
        try:
            self.errors += 1
            name = getattr(listener, "__qualname__", None) or type(listener).__name__
            n = self.errors_by[name] = self.errors_by.get(name, 0) + 1
            if n == 1 or n % 1000 == 0:
                log.exception("verdict listener %s failed (#%d, skipped; the others ran)",
                              name, n)
        except Exception:
            pass
