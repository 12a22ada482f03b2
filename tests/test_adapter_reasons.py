"""Why an adapter call failed, as the metrics say it (issue 20, finding 9): a call refused
because earlier ones are still stuck is its own reason, not a timeout, and every reason an op
can report exists at 0 from the start (a rate() over it is 0, not "no data")."""

from __future__ import annotations

import threading

import sidecar.signals as S
from sidecar.signals import ADAPTER_ERROR_REASONS, AdapterErrorReason, DropReason
from tests.conftest import make_toy

PROMPT = list(range(1, 17))  # 4 full blocks of 4



def test_every_adapter_error_reason_is_created_at_zero() -> None:
    _, _, mon = make_toy()
    try:
        for op, reasons in ADAPTER_ERROR_REASONS.items():
            for why in reasons:
                assert mon.metrics.value(S.ADAPTER_ERRORS.name, op=op, reason=why.value) == 0
        assert AdapterErrorReason.REFUSED in ADAPTER_ERROR_REASONS["read"]
        assert AdapterErrorReason.MISSING_BLOCK in ADAPTER_ERROR_REASONS["recompute"]
        assert mon.metrics.value(S.SAMPLES_DROPPED.name,
                                 reason=DropReason.ADAPTER_REFUSED.value) == 0
    finally:
        mon.stop()


def test_a_refused_call_is_counted_as_refused_not_as_a_timeout() -> None:
    engine, adapter, mon = make_toy(adapter_timeout_s=0.05, blocks_per_sample=1)
    adapter.hang["read"] = threading.Event()  # every read hangs: abandoned, still stuck
    stuck_limit = mon.guard.max_stuck
    mon.start()
    try:
        engine.serve(PROMPT)
        for t in range(stuck_limit + 2):
            engine.serve(PROMPT + [t])
        assert mon.drain(30)
        m = mon.metrics
        assert m.value(S.ADAPTER_ERRORS.name, op="read", reason="timeout") == stuck_limit
        assert m.value(S.ADAPTER_ERRORS.name, op="read", reason="refused") == 2
        assert m.value(S.SAMPLES_DROPPED.name, reason="adapter_timeout") == stuck_limit
        assert m.value(S.SAMPLES_DROPPED.name, reason="adapter_refused") == 2
    finally:
        adapter.hang["read"].set()
        mon.stop()
