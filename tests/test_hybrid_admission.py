"""The on_tier hook (recovery signals, guarded input) and admission control (caps on
concurrent recomputes and recoveries), on the synthetic hybrid toy."""

from __future__ import annotations

import math
import threading

from prometheus_client import generate_latest

from sidecar import signals as S
from sidecar.core.protocol import TierState
from sidecar.signals import DropReason
from tests.hybrid_toy import FULL, PROMPT, RECURRENT, SLIDING, make


def test_on_tier_counts_recoveries_by_group_and_outcome_with_their_latency():
    _, _, monitor = make()
    m = monitor.metrics
    monitor.on_tier(FULL, 3, TierState.LOADING)
    monitor.on_tier(FULL, 3, TierState.LOADED, 0.02)
    monitor.on_tier(SLIDING, 4, TierState.FAILED, 0.5)
    monitor.on_tier(SLIDING, 5, "loaded")  # the state's value is accepted too, no latency
    monitor.on_tier(RECURRENT, 6, TierState.OFFLOADED, 0.1)  # not the end of a load
    assert m.value(S.RECOVERIES.name, group="full", outcome="loaded") == 1
    assert m.value(S.RECOVERIES.name, group="swa", outcome="failed") == 1
    assert m.value(S.RECOVERIES.name, group="swa", outcome="loaded") == 1
    assert m.value(S.RECOVERIES.name, group="conv", outcome="loaded") == 0
    assert m.value(S.RECOVERY_DURATION.name + "_count", group="full") == 1
    assert m.value(S.RECOVERY_DURATION.name + "_count", group="swa") == 1
    assert math.isclose(m.value(S.RECOVERY_DURATION.name + "_sum", group="swa"), 0.5)
    monitor.on_tier(42, 1, TierState.FAILED)  # a group never described: one bounded value
    assert m.value(S.RECOVERIES.name, group="unknown", outcome="failed") == 1


def test_bad_on_tier_input_is_rejected_with_a_reason_and_never_raises():
    _, _, monitor = make()
    m = monitor.metrics
    bad = [((None, 1, TierState.LOADED), "type"), ((0, 1, "warp"), "type"),
           ((0, -1, TierState.LOADED), "negative"), ((0, 1, TierState.LOADED, math.nan), "nan"),
           ((0, 1, TierState.FAILED, -1.0), "negative"),
           ((0, 1, TierState.LOADED, math.inf), "absurd"), ((0, 1, TierState.LOADED, "1"), "type")]
    for args, reason in bad:
        before = m.value(S.HOOK_INPUT_REJECTED.name, hook="on_tier", reason=reason)
        monitor.on_tier(*args)
        assert m.value(S.HOOK_INPUT_REJECTED.name, hook="on_tier", reason=reason) == before + 1
    assert m.value_sum(S.RECOVERIES.name) == 0
    assert m.value(S.HOOK_ERRORS.name, hook="on_tier") == 0
    monitor.group_signals = None  # a bug inside the hook: counted, not raised
    monitor.on_tier(FULL, 1, TierState.LOADED)
    assert m.value(S.HOOK_ERRORS.name, hook="on_tier") == 1


class _Gated:
    """Wraps an adapter op so a test can hold it inside the call."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.go = threading.Event()

    def __call__(self, *args):
        self.entered.set()
        assert self.go.wait(10)
        return self.fn(*args)


def test_recompute_cap_drops_samples_and_a_timed_out_recompute_keeps_its_slot():
    engine, adapter, monitor = make(max_concurrent_recomputes=1, adapter_timeout_s=0.2)
    m = monitor.metrics
    gated = _Gated(adapter.recompute)
    adapter.recompute = gated  # type: ignore[method-assign]
    engine.serve(PROMPT)
    engine.serve(PROMPT)  # hit: its recompute hangs, is abandoned at 0.2 s, still runs
    assert m.value(S.SAMPLES_DROPPED.name, reason=DropReason.ADAPTER_TIMEOUT.value) == 1
    assert monitor.verifier.recomputes.in_flight == 1
    engine.serve(PROMPT)  # the abandoned call holds the only slot: dropped for admission
    assert m.value(S.SAMPLES_DROPPED.name, reason=DropReason.ADMISSION.value) == 1
    gated.go.set()  # the stuck call returns on its own and frees its slot
    for _ in range(100):
        if monitor.verifier.recomputes.in_flight == 0:
            break
        threading.Event().wait(0.02)
    assert monitor.verifier.recomputes.in_flight == 0
    verified = m.value_sum(S.VERIFIED.name)
    engine.serve(PROMPT)
    assert m.value_sum(S.VERIFIED.name) > verified
    assert m.value(S.SAMPLES_DROPPED.name, reason=DropReason.ADMISSION.value) == 1
    assert m.value_sum(S.ANOMALIES.name) == 0


def test_recovery_cap_bounds_verifications_of_tier_served_hits_only():
    engine, adapter, monitor = make(max_concurrent_recoveries=1, max_concurrent_recomputes=0)
    m = monitor.metrics
    other = PROMPT[:8] + [1] * 16
    engine.serve(PROMPT)
    engine.serve(other)
    for (g, b) in list(engine.pool):  # every block of PROMPT came back through the tier
        if b <= 6:
            engine.tier[(g, b)] = TierState.LOADED
    gated = _Gated(adapter.read)
    adapter.read = gated  # type: ignore[method-assign]
    worker = threading.Thread(target=engine.serve, args=(PROMPT,))
    worker.start()
    assert gated.entered.wait(10)  # a recovery verification is reading, holding the slot
    engine.tier.clear()
    adapter.read = gated.fn  # type: ignore[method-assign]
    engine.serve(other[:12])  # device-resident: not a recovery, verified as usual
    assert m.value(S.SAMPLES_DROPPED.name, reason=DropReason.ADMISSION.value) == 0
    engine.tier[(FULL, 1)] = TierState.LOADED
    engine.serve(PROMPT[:8])  # another tier-served hit while the slot is held: dropped
    assert m.value(S.SAMPLES_DROPPED.name, reason=DropReason.ADMISSION.value) == 1
    gated.go.set()
    worker.join(10)
    assert monitor.verifier.recoveries.in_flight == 0
    engine.serve(PROMPT[:8])
    assert m.value(S.SAMPLES_DROPPED.name, reason=DropReason.ADMISSION.value) == 1
    assert m.value_sum(S.ANOMALIES.name) == 0


def test_a_one_group_engine_counts_its_group_hits_in_the_hits_counter_itself():
    from tests.conftest import make_toy

    engine, _, monitor = make_toy(sample_every=1000)
    for n in range(5):
        engine.serve([1, 2, 3, 4, 5, 6, 7, 8, n])
    m = monitor.metrics
    assert m.value(S.HITS.name) == 4
    assert m.value(S.GROUP_HITS.name, group="0", group_kind="full_attention") == 4
    text = generate_latest(m.registry).decode()
    assert f'{S.GROUP_HITS.name}{{engine="toy",group="0",group_kind="full_attention",' \
           f'model="toy-model"}} 4.0' in text
    monitor.stop()
