"""The guard's breaker: whether a request may use the server's prefix cache right now.

* **closed**: every request goes as the user sent it (the cache serves hits);
* **open**: every request gets a fresh ``cache_salt`` (no cached block can match it, so the
  engine recomputes: slower, never wrong because of the cache). Any anomaly (a sampled
  verdict, a page, an operator) opens it from any state and restarts its hold;
* **half-open**: ``hold_s`` after the last anomaly, 1 request in ``probe_every`` goes with
  the cache again (a probe) and the rest stay bypassed; ``probes`` clean verdicts in a row
  close it, an anomalous one opens it again, and so do ``probe_errors`` probes that got no
  verdict (the server answered an error, or an answer the verifier could not compare):
  an upstream that fails every probe must not keep users on the cache for ever.

Unlike :class:`sidecar.protect.actions.CircuitBreaker` (K anomalies within a window, inside an
engine the sidecar drives), this one opens on the first anomaly: in front of a black-box
server, one sampled anomaly stands for about ``sample_every`` wrong answers already served.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class State(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Route(enum.StrEnum):
    """What the guard does with one request (the ``route`` label of guard_requests_total)."""

    FORWARDED = "forwarded"  # closed: as sent
    BYPASSED = "bypassed"  # open, or half-open and not a probe: with a fresh cache_salt
    PROBE = "probe"  # half-open: with the cache, and verified
    UNPROTECTED = "unprotected"  # open, but not salted (the server ignores cache_salt, or a
    # non-generation /v1/ route whose body is not a JSON object): forwarded as sent
    REFUSED = "refused"  # open, a generation request the guard cannot salt: answered 4xx


class Source(enum.StrEnum):
    """Why the breaker moved (the ``source`` label of guard_transitions_total)."""

    LOCAL = "local"  # a verdict of the guard's own replay verifier
    SIDECAR = "sidecar"  # a kv-sidecar's /status (anomalies / verified counters)
    WEBHOOK = "webhook"  # an Alertmanager page
    OPERATOR = "operator"  # an authenticated POST
    TIMER = "timer"  # the hold ran out: half-open
    PROBES = "probes"  # M clean probe verdicts: closed
    PROBE_ERRORS = "probe_errors"  # K probes without a verdict while half-open: open again


@dataclass(frozen=True)
class BreakerSettings:
    hold_s: float = 60.0
    probes: int = 5
    probe_every: int = 4
    probe_errors: int = 3

    def __post_init__(self) -> None:
        if not (0 < self.hold_s <= 86400):
            raise ValueError(f"hold_s must be in (0, 86400], got {self.hold_s!r}")
        if not (1 <= self.probes <= 10_000 and 1 <= self.probe_every <= 10_000
                and 1 <= self.probe_errors <= 10_000):
            raise ValueError("probes, probe_every and probe_errors must be in 1..10000")


Listener = Callable[[State, State, Source], None]


class BypassBreaker:
    """Thread-safe: forwarding threads ask :meth:`route`, verdict sources call
    :meth:`anomaly` / :meth:`clean`, operators :meth:`force`."""

    def __init__(self, settings: BreakerSettings | None = None,
                 on_transition: Listener | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or BreakerSettings()
        self._listener = on_transition
        self._clock = clock
        self._lock = threading.Lock()
        self.state = State.CLOSED
        self._opened_at = 0.0
        self._clean = 0
        self._errors = 0
        self._seen = itertools.count()
        self.transitions: list[tuple[State, State, Source]] = []

    @property
    def clean_probes(self) -> int:
        return self._clean

    def _move(self, to: State, source: Source) -> None:
        """Caller holds the lock."""
        was = self.state
        if was is to:
            return
        self.state = to
        self._clean = 0
        self._errors = 0
        self.transitions.append((was, to, source))
        del self.transitions[:-64]
        log.warning("guard breaker %s -> %s (%s)", was, to, source)
        if self._listener is not None:
            self._listener(was, to, source)

    def _tick(self) -> None:
        if self.state is State.OPEN and \
                self._clock() - self._opened_at >= self.settings.hold_s:
            self._move(State.HALF_OPEN, Source.TIMER)

    def current(self) -> State:
        with self._lock:
            self._tick()
            return self.state

    def route(self) -> Route:
        """The route of the next request."""
        with self._lock:
            self._tick()
            if self.state is State.CLOSED:
                return Route.FORWARDED
            if self.state is State.HALF_OPEN and \
                    next(self._seen) % self.settings.probe_every == 0:
                return Route.PROBE
            return Route.BYPASSED

    def anomaly(self, source: Source) -> None:
        with self._lock:
            self._opened_at = self._clock()
            self._move(State.OPEN, source)
            self._clean = 0

    def clean(self, source: Source, n: int = 1) -> None:
        """``n`` clean verdicts; they count only while half-open (they verify probes)."""
        with self._lock:
            self._tick()
            if self.state is not State.HALF_OPEN:
                return
            self._clean += n
            if self._clean >= self.settings.probes:
                self._move(State.CLOSED, Source.PROBES)

    def probe_failed(self) -> None:
        """A probe got no verdict; ``probe_errors`` of them while half-open open it again
        (counted only while half-open: they stand in for the verdicts that close it)."""
        with self._lock:
            self._tick()
            if self.state is not State.HALF_OPEN:
                return
            self._errors += 1
            if self._errors >= self.settings.probe_errors:
                self._opened_at = self._clock()
                self._move(State.OPEN, Source.PROBE_ERRORS)

    def force(self, to: State) -> None:
        """An operator's decision: open (as an anomaly), half-open (probe now) or closed."""
        if to is State.OPEN:
            self.anomaly(Source.OPERATOR)
            return
        with self._lock:
            self._move(to, Source.OPERATOR)
