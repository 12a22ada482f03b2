"""Nudged allocator polls run on the poller's nudge thread (sidecar/allocator/poller.py): a
nudge polls soon, nudges while one is due collapse into it, a nudge during a poll asks for
exactly one more, ``min_interval_s`` spaces them, and ``< 0`` turns them off."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry

from sidecar.allocator.poller import AllocatorPoller
from sidecar.core.protocol import AllocatorState
from sidecar.export.metrics import Metrics

HANG_S = 60.0  # bounds a hang only


class Counting:
    """An adapter whose ``block_tables`` counts calls and can be held open by a test."""

    def __init__(self) -> None:
        self.tables = 0
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    def allocator(self) -> AllocatorState:
        return AllocatorState(total_blocks=8, free_blocks=8)

    def block_tables(self) -> list:
        self.entered.set()
        self.release.wait(HANG_S)
        self.tables += 1
        return []


class Health:
    def observe(self, *args: object, **kwargs: object) -> None:
        pass


def _poller(adapter: Counting, min_interval_s: float) -> AllocatorPoller:
    return AllocatorPoller(adapter, Metrics("e", "m", CollectorRegistry()), Health(),  # type: ignore[arg-type]
                           lambda: 0, HANG_S, 0.0, min_interval_s, introspection=adapter)


def _wait(what, timeout_s: float = HANG_S) -> None:
    end = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_nudge_polls_and_nudges_while_due_collapse() -> None:
    adapter = Counting()
    poller = _poller(adapter, 0.0)
    poller.nudge()  # before start: nothing runs, nothing raises
    poller.start()
    try:
        adapter.release.clear()
        poller.nudge()
        assert adapter.entered.wait(HANG_S)  # the nudged poll runs, held open here
        for _ in range(100):  # during the poll: one more, not a backlog
            poller.nudge()
        adapter.release.set()
        _wait(lambda: poller.nudged_polls == 2)
        time.sleep(0.2)
        assert poller.nudged_polls == 2 and adapter.tables == 2
        poller.nudge()
        _wait(lambda: poller.nudged_polls == 3)
    finally:
        poller.stop()
    poller.nudge()  # after stop: nothing runs, nothing raises
    assert poller.nudged_polls == 3


def test_nudged_polls_are_at_least_min_interval_apart() -> None:
    adapter = Counting()
    poller = _poller(adapter, 0.5)
    poller.start()
    try:
        poller.nudge()
        _wait(lambda: poller.nudged_polls == 1)
        first = time.monotonic()
        poller.nudge()
        _wait(lambda: poller.nudged_polls == 2)
        assert time.monotonic() - first >= 0.45  # due min_interval_s after the first began
    finally:
        poller.stop()


def test_a_negative_interval_turns_nudged_polls_off() -> None:
    adapter = Counting()
    poller = _poller(adapter, -1.0)
    poller.start()
    try:
        poller.nudge()
        time.sleep(0.3)
        assert poller.nudged_polls == 0 and adapter.tables == 0
    finally:
        poller.stop()


def test_a_nudge_while_one_waits_behind_a_poll_is_never_lost() -> None:
    """A nudged poll waiting for the lock still counts as due: a nudge then collapses into it
    instead of adding a third (with APScheduler one-shot jobs, a refused third left nudges
    "due" for good: the allocator demo then polled 14 times in 150 requests)."""
    adapter = Counting()
    poller = _poller(adapter, 0.0)
    poller.start()
    try:
        adapter.release.clear()
        poller.nudge()
        assert adapter.entered.wait(HANG_S)  # the first nudged poll, held open
        poller.nudge()  # one more, asked for while the first runs
        for _ in range(10):
            poller.nudge()
        adapter.release.set()
        _wait(lambda: poller.nudged_polls == 2)
        poller.nudge()  # nudges still work
        _wait(lambda: poller.nudged_polls == 3)
    finally:
        poller.stop()


def test_a_restarted_poller_polls_on_nudges_and_a_stop_ends_its_thread() -> None:
    adapter = Counting()
    poller = _poller(adapter, 0.0)
    for round_ in (1, 2):
        poller.start()
        thread = poller._nudger
        assert thread is not None and thread.is_alive() and poller.alive
        poller.nudge()
        _wait(lambda: poller.nudged_polls == round_)  # noqa: B023 (waited on here)
        poller.stop()
        thread.join(HANG_S)
        assert not thread.is_alive()
        poller.nudge()  # stopped: nothing runs
    assert poller.nudged_polls == 2 and adapter.tables == 2


def test_polls_refused_behind_stuck_calls_are_counted_as_refused() -> None:
    """An allocator() that never returns: four polls time out (each leaves its call stuck),
    later ones are refused without calling it, and say so (they were counted as errors)."""
    from sidecar import signals as S

    hang = threading.Event()

    class Hung(Counting):
        def allocator(self) -> AllocatorState:
            hang.wait(HANG_S)
            return super().allocator()

    metrics = Metrics("e", "m", CollectorRegistry())
    poller = AllocatorPoller(Hung(), metrics, Health(), lambda: 0, 0.02, 0.0, -1.0)  # type: ignore[arg-type]
    try:
        for _ in range(7):
            poller.poll()
        count = lambda reason: metrics.value(S.ADAPTER_ERRORS.name,  # noqa: E731
                                             op="allocator", reason=reason)
        assert (count("timeout"), count("refused"), count("error")) == (4, 3, 0)
    finally:
        hang.set()
