"""The SGLang tap's shipper: the messages SGLang's thread queued, packed and sent off it.

Profiled in a real server at 1 in 1000, a ZMQ send on SGLang's scheduler thread took ~38 us
of CPU but ~300 us of wall time (it wakes ZMQ's I/O thread, which took the scheduler's core
on a busy host), and the tap sent a batch every ~8 requests. So the tap's hooks only append
``(kind, fields)`` to a bounded queue, in order, and a thread of the tap's own drains it
every :data:`SHIP_EVERY_S` (sooner once :data:`WAKE_AT` wait), packs and sends; ``events``
batches queued back to back leave as one message of at most :data:`RUN_ITEMS` items.

Three rare messages go at once, on the caller's thread, with everything queued before them
(``now``): hello, a sampled hit's capture and a census, so an engine about to fail has sent
what it checked (a fault test's SGLang exits right after the census that sees its fault)
— unless more than :data:`WAKE_AT` messages or :data:`AT_ONCE_ITEMS` events wait (the
shipper is behind, or a hook handed over thousands: the caller wakes the shipper instead of
packing the backlog on SGLang's thread). One thread sends at a time (the socket
is not thread-safe). Past :data:`READY_LIMIT` messages or :data:`READY_ITEMS` events
waiting, and for a message that cannot be packed, the pipe accounts it as one it could not
send (a capture a dropped sample whose lookup still counts, a batch's lookups carried, the
rest a lost message). On a quiet server after an outage, lookups the pipe carries are
retried every period, and a loss the sidecar was not told of yet is told. The shipper's CPU
time (``ship_ns``) counts in the tap's time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sidecar.adapters.vllm.pipe import Pipe

log = logging.getLogger(__name__)

SHIP_EVERY_S = 0.25  # the shipper drains its queue this often when nobody wakes it
WAKE_AT = 64  # messages waiting at which the caller wakes the shipper
AT_ONCE_ITEMS = 1024  # events waiting past which an at-once message wakes the shipper instead
READY_LIMIT = 1024  # messages waiting for the shipper; past it each is accounted unsent
READY_ITEMS = 1 << 18  # events waiting for the shipper; past it, the same
RUN_ITEMS = 4096  # items of one events message (the receiver caps a message at 2**18)


def _items(run: list[Any]) -> list[Any] | None:
    f = run[1]
    return f.get("items", f.get("ids"))


def _count(kind: str, fields: dict[str, Any]) -> int:
    """Events a message carries (one for any other message)."""
    if kind != "events":
        return 1
    return sum(len(_items(r) or ()) for r in fields["runs"]) or 1


def split_runs(runs: list[list[Any]]) -> list[list[list[Any]]]:
    """``runs`` (``[[kind, fields], ...]``) as messages of at most :data:`RUN_ITEMS` items,
    in order: one hook can hand over more (a cache flush frees every stored block, a long
    prompt stores thousands) than the receiver takes in one message."""
    if sum(len(_items(r) or ()) for r in runs) <= RUN_ITEMS:
        return [runs]
    out: list[list[list[Any]]] = []
    cur: list[list[Any]] = []
    total = 0
    for kind, fields in runs:
        items = _items([kind, fields])
        if items is None:
            cur.append([kind, fields])
            continue
        key = "ids" if "ids" in fields else "items"
        at = 0
        while True:
            if total >= RUN_ITEMS:
                out.append(cur)
                cur, total = [], 0
            chunk = items[at:at + RUN_ITEMS - total]
            cur.append([kind, {**fields, key: chunk}])
            total += len(chunk)
            at += len(chunk)
            if at >= len(items):
                break
    out.append(cur)
    return out


class TapShipper:
    """The queue and the thread (module docstring). ``stats``: the tap's ``tap_stats``
    fields, taken when they are sent."""

    def __init__(self, pipe: Pipe, stats: Callable[[], dict[str, int]]) -> None:
        self.pipe = pipe
        self._stats = stats
        self.errors = 0  # messages that could not be packed
        self.ship_ns = 0  # this thread's CPU time
        self._ready: deque[tuple[str, dict[str, Any], int]] = deque()
        # Events queued and shipped, each counter written by one thread (queued by the
        # caller's, SGLang's; shipped under the lock): their difference is the backlog.
        self._queued = 0
        self._shipped = 0
        self._counts_sent: tuple[int, int, int] = (0, 0, 0)  # the pipe's losses last told
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._thread: threading.Thread | None = None

    def send(self, kind: str, fields: dict[str, Any], now: bool = False) -> None:
        """Queue one message (the caller's thread: an append, no lock); ``now``: send it,
        and what waits before it, on this thread (module docstring)."""
        ready = self._ready
        n = _count(kind, fields)
        backlog = self._queued - self._shipped
        if len(ready) >= READY_LIMIT or backlog + n > READY_ITEMS or self._closing:
            self.pipe.account_unsent(kind, **fields)
            return
        ready.append((kind, fields, n))
        self._queued += n
        if now and len(ready) <= WAKE_AT and backlog <= AT_ONCE_ITEMS:
            self.ship()
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="kvsidecar-sglang-ship")
            self._thread.start()
        elif (now or len(ready) >= WAKE_AT) and not self._wake.is_set():
            self._wake.set()  # set() takes a lock: once is enough

    def _loop(self) -> None:
        while not self._closing:
            self._wake.wait(SHIP_EVERY_S)
            self._wake.clear()
            c0 = time.thread_time_ns()
            try:
                self.ship()
                if not self._ready:
                    self._tell_losses()
            except Exception:  # the thread must outlive any one message: counted
                self.errors += 1
                log.exception("kv-sidecar sglang tap: shipping failed (counted)")
            self.ship_ns += time.thread_time_ns() - c0

    def _tell_losses(self) -> None:
        """On a quiet server after an outage: lookups the pipe carries are retried, and a
        loss the sidecar has not heard of yet is told (every message carries the pipe's
        loss counts: a tap_stats does)."""
        pipe = self.pipe
        counts = pipe.loss_counts
        if not pipe.carried and counts == self._counts_sent:
            return
        with self._lock:
            if pipe.try_send("tap_stats", **self._stats()):
                self._counts_sent = counts

    def ship(self) -> None:
        """Send what the queue holds, in order, on the calling thread."""
        with self._lock:
            ready = self._ready
            while ready:
                kind, fields, n = ready.popleft()
                if kind == "events":
                    runs, more = _merged(fields["runs"], ready)
                    n += more
                    for piece in split_runs(runs):
                        self._send(kind, {"runs": piece})
                else:
                    self._send(kind, self._stats() if kind == "tap_stats" else fields)
                self._shipped += n

    def _send(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "events":
            for run in fields["runs"]:
                if run[0] == "tap_stats":  # as of now: the shipper's time and errors too
                    run[1] = self._stats()
        pipe = self.pipe
        counts = pipe.loss_counts
        try:
            if pipe.send_message(kind, **fields):
                self._counts_sent = counts  # the message carried them (at least)
        except Exception:  # not packable (a value msgpack refuses): counted
            self.errors += 1
            log.exception("kv-sidecar sglang tap: sending a %s failed (counted)", kind)
            try:
                self.pipe.account_unsent(kind, **fields)
            except Exception:
                self.pipe.account_unsent("unsendable")

    def close(self, timeout_s: float = 2.0) -> bool:
        """Let the thread send what waits (a bounded wait); False while it still runs (the
        socket is then still its own)."""
        self._closing = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        self.ship()
        return True


def _merged(runs: list[list[Any]], ready: deque[tuple[str, dict[str, Any], int]]
            ) -> tuple[list[Any], int]:
    """``runs`` and the runs of the ``events`` messages queued right behind it, as one
    message (a run of one kind continued by the next message's run of that kind), up to
    :data:`RUN_ITEMS` items, and the events the messages taken from ``ready`` counted: the
    shipper sends one message where SGLang's thread handed over several."""
    total = sum(len(_items(r) or ()) for r in runs)
    taken = 0
    while ready and ready[0][0] == "events" and total < RUN_ITEMS:
        _, fields, n = ready.popleft()
        taken += n
        for run in fields["runs"]:
            items, last = _items(run), runs[-1]
            if items is not None and last[0] == run[0] and _items(last) is not None:
                _items(last).extend(items)  # type: ignore[union-attr]
            else:
                runs.append(run)
            total += len(items or ())
    return runs, taken
