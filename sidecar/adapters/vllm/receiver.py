"""The sidecar's end of the probe pipe: a ZMQ PULL socket drained by a daemon thread.

It turns probe messages into calls: ``lookups`` and sampled ``capture`` messages into
``on_lookup``-style callbacks (the caller forwards them to the Monitor), reference captures
into the result of the engine-side recompute that asked for them (:meth:`expect`), and the
``hello`` into a check that the engine is the one the sidecar was configured for. Other
kinds go to the ``handlers`` the owner names (SGLang's tap also sends stores, frees and a
pool census over the same pipe); an unknown kind is a bad message.

The socket is an ingest surface, so it is locked down: only ``ipc://`` paths (created 0600,
owner only, and only under :data:`IPC_DIRS` unless told otherwise) or ``tcp://127.0.0.1``
are accepted. What a peer claims is clamped: each loss count of a pipe may only grow
by :data:`MAX_DROP_STEP` per message, all pipes together by a :class:`DropBudget` (a token
bucket: :data:`DROP_BURST`, refilled at :data:`DROP_RATE_PER_S`), at most
:data:`MAX_SOURCES` pipes are tracked, and lookups per message are capped, so neither one
message nor many senders can add 9.2e18 (or millions) to a counter or mint unbounded state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import zmq

from sidecar import signals as S
from sidecar.adapters.vllm.endpoints import (
    IPC_DIRS,
    bound_file,
    check_endpoint,
    remove_bound_file,
)
from sidecar.adapters.vllm.wire import MAX_LOOKUPS, Capture, WireError, decode_capture, unpack
from sidecar.export.metrics import Metrics
from sidecar.signals import DropReason

log = logging.getLogger(__name__)

MAX_SOURCES = 64  # pipes tracked for drop accounting (two per probe worker)
MAX_DROP_STEP = 1 << 20  # a pipe cannot have dropped more than this between two messages
MAX_RUNS = 65_536  # runs in one events message (an outbox flushes at 64 items)
MAX_EVENT_ITEMS = 1 << 18  # stores, frees and lookups in one (a cache flush frees
# every stored block at once: 62k of a 1M-slot pool)
# SGLang's tap's kinds, then an in-process engine's front's (sidecar.adapters.remote.front)
# The hook label a bad message counts under: the pipe carries vLLM's probe, SGLang's tap and
# an in-process engine's front (dispatch = "process") alike.
BAD_MESSAGE_HOOK = "probe_message"
BATCHED_KINDS = frozenset({"lookups", "stores", "frees", "tap_stats", "block_stores",
                           "block_frees", "lifecycle", "requests", "tiers"})
# Drops all pipes together may report: far above what a probe can really drop (a message per
# engine step, a few thousand steps a second), far below what a liar would claim.
DROP_RATE_PER_S = 10_000
DROP_BURST = 100_000


class DropBudget:
    """How many peer-reported drops may still be counted: a token bucket shared by every
    sender, so N senders claiming 2**63-1 add at most ``burst + rate * elapsed`` in all."""

    def __init__(self, rate_per_s: float = DROP_RATE_PER_S, burst: int = DROP_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate_per_s
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self, wanted: int) -> int:
        """Up to ``wanted`` drops that may be counted now (the rest are refused)."""
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        granted = min(wanted, int(self._tokens))
        self._tokens -= granted
        return granted


class ProbeReceiver:
    """Binds ``endpoint`` and dispatches probe messages (see the module docstring)."""

    def __init__(self, endpoint: str, metrics: Metrics,
                 on_lookups: Callable[[list[tuple[int, int]]], None],
                 on_capture: Callable[[Capture], None],
                 on_hello: Callable[[dict[str, Any]], None] | None = None,
                 context: zmq.Context | None = None,
                 ipc_dirs: tuple[str, ...] | None = None,
                 groups: Iterable[int] | None = None,
                 handlers: Mapping[str, Callable[[dict[str, Any]], None]] | None = None,
                 sources: Iterable[str] | None = None) -> None:
        check_endpoint(endpoint, IPC_DIRS if ipc_dirs is None else ipc_dirs)
        # Cache groups the engine has (describe()): a capture naming another is refused,
        # so a sender cannot choose the group label of what gets verified.
        self.groups = frozenset(groups) if groups is not None else None
        # The only senders accepted, where the owner knows them (an in-process engine's
        # front names a secret src the sidecar process got on spawn): any other process of
        # the same user on the socket is refused, counted as a bad message.
        self.sources = frozenset(sources) if sources is not None else None
        self.endpoint = endpoint
        self.metrics = metrics
        metrics.register(S.VLLM_SIGNALS)  # the vLLM adapter's own signals
        self.on_lookups = on_lookups
        self.on_capture = on_capture
        self.on_hello = on_hello
        self.handlers = dict(handlers or {})
        self.hello: dict[str, Any] | None = None
        self.messages = 0
        self.bad_messages = 0
        self.last_message_at = time.monotonic()
        self._ctx = context or zmq.Context.instance()
        self._dropped: dict[str, dict[str, int]] = {}  # src -> loss -> total
        self.drop_budget = DropBudget()
        self.drops_refused = 0  # claimed drops over the budget: not counted as samples
        self._refusals = 0
        self._waiting: dict[str, Future[Capture]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> ProbeReceiver:
        self._thread = threading.Thread(target=self._run, name="kvsidecar-vllm-probe",
                                        daemon=True)
        self._thread.start()
        self._bound.wait(5.0)
        if self._error is not None:
            raise RuntimeError(f"cannot bind the probe socket {self.endpoint}: {self._error}")
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def expect(self, salt: str) -> Future[Capture]:
        """A future for the reference capture the probe will send for ``salt``."""
        fut: Future[Capture] = Future()
        with self._lock:
            self._waiting[salt] = fut
        return fut

    def forget(self, salt: str) -> None:
        with self._lock:
            self._waiting.pop(salt, None)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            old = os.umask(0o177)  # the ipc socket file is created 0600: owner only
            try:
                sock.bind(self.endpoint)
            finally:
                os.umask(old)
            if self.endpoint.startswith("ipc://"):
                os.chmod(self.endpoint.removeprefix("ipc://"), 0o600)
            socket_file = bound_file(self.endpoint)
        except (zmq.ZMQError, OSError) as exc:
            self._error = exc
            self._bound.set()
            sock.close(0)
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self.handle(sock.recv())
        finally:
            sock.close(0)
            remove_bound_file(self.endpoint, socket_file)

    @property
    def alive(self) -> bool:
        """The draining thread is running (``/healthz`` reports it)."""
        return self._thread is not None and self._thread.is_alive()

    def handle(self, data: bytes) -> None:
        """Dispatch one message; a bad one is counted and logged, never raised."""
        self.last_message_at = time.monotonic()
        try:
            msg = unpack(data)
            if self.sources is not None and msg.get("src") not in self.sources:
                raise WireError("a message from a sender this sidecar does not know")
            self._account_drops(msg)
            kind = msg["kind"]
            if kind == "events":
                self._events(msg.get("runs"), msg.get("src"))
            elif kind == "lookups":
                self.on_lookups(decode_lookups(msg.get("items", [])))
            elif kind == "capture":
                self._capture(decode_capture(msg))
            elif kind == "hello":
                self.hello = msg
                if self.on_hello is not None:
                    self.on_hello(msg)
            elif kind in self.handlers:
                self.handlers[kind](msg)
            else:
                raise ValueError(f"unknown message kind {kind!r}")
            self.messages += 1
        except Exception as exc:
            self.bad_messages += 1
            self.metrics.inc(S.HOOK_ERRORS, hook=BAD_MESSAGE_HOOK)
            n = self.bad_messages
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood of them is no log flood
                log.warning("bad kv-sidecar probe message skipped (%d so far): %s: %s",
                            n, type(exc).__name__, exc)

    def _events(self, runs: Any, src: Any) -> None:
        """An ordered batch (SGLang's tap: its outbox in one message): ``[[kind, fields],
        ...]``, each run handled as a message of that kind with those fields would be, sent
        by the batch's ``src``; kinds of :data:`BATCHED_KINDS` only (never a capture,
        hello, census or nested batch). Checked whole first (shapes, kinds, at most
        :data:`MAX_EVENT_ITEMS` items in all: the per-kind caps hold per run, and an outside
        check applied 10M lookups from one 30 MB batch for 40 s); then a bad run's items
        end the batch, the runs before it applied, as a bad item within a ``stores``
        message does."""
        if not isinstance(runs, list) or len(runs) > MAX_RUNS:
            raise WireError("events is not a bounded list of runs")
        items = 0
        for run in runs:
            if not isinstance(run, list) or len(run) != 2 or not isinstance(run[1], dict):
                raise WireError("an events run is not [kind, fields]")
            if run[0] not in BATCHED_KINDS:
                raise WireError(f"an events run of kind {str(run[0])[:40]!r}")
            listed = run[1].get("ids" if run[0] == "frees" else "items")
            items += len(listed) if isinstance(listed, list) else 0
        if items > MAX_EVENT_ITEMS:
            raise WireError(f"events carries {items} items, over {MAX_EVENT_ITEMS}")
        for kind, fields in runs:
            if kind == "lookups":
                self.on_lookups(decode_lookups(fields.get("items", [])))
            elif kind in self.handlers:
                self.handlers[kind]({**fields, "src": src})
            else:
                raise WireError(f"an events run of kind {kind!r}: no handler here")

    def _capture(self, cap: Capture) -> None:
        if self.groups is not None and not (set(cap.blocks) <= self.groups and
                                            all(g in self.groups for g, _ in cap.kv)):
            raise WireError("capture names a cache group the engine does not have")
        if cap.role == "reference":
            with self._lock:
                fut = self._waiting.pop(cap.salt or "", None)
            if fut is not None and not fut.done():
                fut.set_result(cap)
            return
        self.on_capture(cap)

    def _account_drops(self, msg: dict[str, Any]) -> None:
        """Each cumulative loss a pipe reports, counted once as what it was: dropped
        captures as dropped samples, lost lookups and other lost messages apart."""
        src = msg.get("src", "")
        claims = {f: msg.get(f, 0) for f in _LOSSES}
        if not isinstance(src, str) or len(src) > 64 or \
                not all(type(v) is int and v >= 0 for v in claims.values()):
            raise WireError("src or a loss count (dropped, lost_*) is malformed")
        known = self._dropped.get(src)
        if known is None:
            if len(self._dropped) >= MAX_SOURCES:
                return  # unknown extra pipe: its claims are not counted
            known = self._dropped[src] = dict.fromkeys(_LOSSES, 0)
        for name, claimed_total in claims.items():
            before = known[name]
            if claimed_total <= before:
                continue
            claimed = claimed_total - before
            step = self.drop_budget.take(min(claimed, MAX_DROP_STEP))
            if step:
                signal, labels = _LOSSES[name]
                self.metrics.inc(signal, step, **labels)
            if step < claimed:  # the excess is a lie or a burst no probe can produce
                self.drops_refused += claimed - step
                self._refusals += 1
                if self._refusals & (self._refusals - 1) == 0:  # 1st, 2nd, 4th, ...: no flood
                    log.warning("probe pipe %r claims %d %s; %d counted (over the budget)",
                                src[:64], claimed, name, step)
            known[name] = claimed_total  # the claim is the new baseline: never re-counted


# The cumulative loss counts on every probe message (pipe.py): what each is counted as.
_LOSSES: dict[str, tuple[S.Signal, dict[str, str]]] = {
    "dropped": (S.SAMPLES_DROPPED, {"reason": DropReason.QUEUE_FULL.value}),
    "lost_lookups": (S.PROBE_LOST, {"what": S.ProbeLoss.LOOKUPS.value}),
    "lost_messages": (S.PROBE_LOST, {"what": S.ProbeLoss.MESSAGES.value}),
}


def decode_lookups(items: Any) -> list[tuple[int, int]]:
    if not isinstance(items, list) or len(items) > MAX_LOOKUPS:
        raise WireError("lookups is not a bounded list")
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 2 or type(item[0]) is not int or \
                type(item[1]) is not int:
            raise WireError("a lookup is not [query_tokens, hit_tokens]")
        out.append((item[0], item[1]))
    return out
