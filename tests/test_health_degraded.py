"""/healthz says why the allocator checks are blind (``degraded``), without failing
liveness: allocator()/block_tables() calls stuck, timing out, raising or returning garbage
poll after poll (sidecar.allocator.poller.AllocatorPoller.degraded)."""

from __future__ import annotations

import threading
import time

import pytest

from sidecar import signals as S
from sidecar.core.health import monitor_health
from tests.conftest import make_toy


def test_healthz_says_when_allocator_calls_are_stuck(monkeypatch) -> None:
    """An allocator() that never returns: once the guard refuses further calls the allocator
    checks are blind, and /healthz says so (``degraded``) without failing liveness (a
    restart would not unwedge the engine); it clears when the calls return."""
    _, adapter, mon = make_toy(adapter_timeout_s=0.02, allocator_check_min_interval_s=-1)
    hang = threading.Event()
    real = adapter.allocator

    def hung():
        hang.wait(60)
        return real()

    monkeypatch.setattr(adapter, "allocator", hung)
    mon.start()
    try:
        assert monitor_health(mon)["degraded"] == []
        for _ in range(mon.poller.guard.max_stuck):
            mon.poll_allocator()
        health = monitor_health(mon)
        assert health["degraded"] == ["allocator_calls_stuck"]
        assert health["ok"]
        hang.set()
        deadline = time.monotonic() + 30
        while mon.poller.degraded and time.monotonic() < deadline:
            time.sleep(0.01)
            mon.poll_allocator()  # answered once the stuck calls have returned
        assert monitor_health(mon)["degraded"] == []
    finally:
        hang.set()
        mon.stop()


@pytest.mark.parametrize("misbehaviour", ["slow", "raises", "garbage"])
def test_healthz_says_when_every_allocator_call_fails(monkeypatch, misbehaviour) -> None:
    """Never four stuck at once, yet no poll answered: an allocator() always slower than
    its limit (an outside check: 60 of 60 polls without state, never said), or one that
    always raises or returns garbage. Said after BLIND_AFTER polls in a row; one answer
    clears it."""
    from sidecar.allocator.poller import BLIND_AFTER

    # A raise or garbage must not turn into a timeout on a loaded box: a roomy limit there.
    _, adapter, mon = make_toy(adapter_timeout_s=0.02 if misbehaviour == "slow" else 5.0,
                               allocator_check_min_interval_s=-1)
    real = adapter.allocator
    broken = threading.Event()
    broken.set()

    def allocator():
        if broken.is_set():
            if misbehaviour == "raises":
                raise RuntimeError("allocator unavailable")
            if misbehaviour == "garbage":
                return ["not", "an", "AllocatorState"]
            time.sleep(0.1)  # past the 0.02 s limit, returns on its own
        return real()

    monkeypatch.setattr(adapter, "allocator", allocator)
    mon.start()
    try:
        expect = {"slow": "allocator_calls_stuck", "raises": "allocator_calls_failing",
                  "garbage": "allocator_calls_failing"}
        assert monitor_health(mon)["degraded"] == []  # start's own poll failed: one
        for _ in range(BLIND_AFTER - 1):
            mon.poll_allocator()
            time.sleep(0.12)  # the slow call returns: never stuck 4 at once
        assert monitor_health(mon)["degraded"] == [expect[misbehaviour]]
        broken.clear()
        deadline = time.monotonic() + 30  # one answered poll clears it (a loaded box may
        while mon.poller.degraded and time.monotonic() < deadline:  # time one out)
            mon.poll_allocator()
        assert monitor_health(mon)["degraded"] == []
    finally:
        mon.stop()


def test_block_tables_garbage_is_counted_and_said() -> None:
    """block_tables() returning what is no sequence of snapshots: counted as garbage (it
    was only logged as a failed check) and, poll after poll, said in /healthz."""
    from sidecar.allocator.poller import BLIND_AFTER

    _, _, mon = make_toy(adapter_timeout_s=5.0, allocator_check_min_interval_s=-1,
                               allocator_every_s=0)

    class Tables:
        def block_tables(self):
            return "garbage"

    mon.poller._introspection = Tables()  # type: ignore[assignment]
    try:
        for _ in range(BLIND_AFTER):
            mon.poll_allocator()
        assert mon.metrics.value(S.ADAPTER_ERRORS.name, op="block_tables",
                                 reason="garbage") == BLIND_AFTER
        assert monitor_health(mon)["degraded"] == ["allocator_calls_failing"]
    finally:
        mon.stop()
