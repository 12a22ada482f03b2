"""The background scrub (sidecar/checks/scrub.py) on the real reference engine: it finds a fault in
an entry nobody hits again, stays within its recompute budget, skips under load, jumps the
queue for blocks near an anomaly or back from a tier, and differs between replicas."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

from sidecar import signals as S
from sidecar.checks.recompute_budget import RecomputeBudget
from sidecar.checks.scrub import ScrubSettings
from sidecar.core.compose import scrubber_for
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import TierState
from tests.limits import DETECTION_TIMEOUT_S
from tests.reference_helpers import SMALL_POOL

# The hit path effectively never samples (1 in 10^6): whatever is found, the scrub found.
QUIET = SidecarConfig(sample_every=10**6, dispatch="inline", allocator_every_s=0,
                      recompute_tokens_per_s=0, scrub_idle_s=0, scrub_blocks_per_tick=8,
                      scrub_tokens_per_minute=1e9, scrub_seed=7, burst_hits=0,
                      adapter_timeout_s=DETECTION_TIMEOUT_S)
# A few conversations: enough resident blocks with real prefixes, in about a second.
WARM = WorkloadConfig(conversations=8, max_turns=4)


def _warm(config: SidecarConfig = QUIET) -> tuple[ReferenceEngine, Monitor]:
    engine = ReferenceEngine(EngineConfig(num_blocks=SMALL_POOL))
    monitor = Monitor(ReferenceAdapter(engine), config)
    engine.sink = monitor
    drive(engine, ChatWorkload(WARM))
    monitor.journal.drain()
    return engine, monitor


def _cached_deep_block(engine: ReferenceEngine) -> int:
    """An unreferenced, indexed block with a prefix before it (a real chain to rebuild)."""
    pool = engine.pool
    _, cached, _ = pool.lists()
    return next(b for b in cached if pool.blocks[b].prefix_tokens >= 2 * engine.block_size)


def _anomalies(monitor: Monitor) -> float:
    return monitor.metrics.value_sum(S.ANOMALIES.name)


def test_a_fault_in_an_entry_never_hit_again_is_found_by_the_scrub_alone() -> None:
    engine, monitor = _warm(replace(QUIET, scrub=True))
    bad = _cached_deep_block(engine)
    engine.pool.key[1, bad, 0, 5] += 0.5  # one token row of one layer goes wrong, in place
    assert _anomalies(monitor) == 0
    resident = len(monitor.stored.resident())
    scrubber = monitor.scrubber
    assert scrubber is not None
    verdicts = scrubber.run_pass()
    anomalous = [v for v in verdicts if v.findings]
    assert [v.sample.refs[0].block_id for v in anomalous] == [bad]
    assert anomalous[0].kinds() == {S.AnomalyKind.RECOMPUTE_MISMATCH}
    assert monitor.metrics.value(S.ANOMALIES.name, group="full",
                                 kind="recompute_mismatch") == 1
    assert monitor.metrics.value(S.SAMPLED.name) == 0  # the hit path never looked
    m = monitor.metrics
    clean = m.value(S.SCRUB_VERIFIED.name, result="clean")
    assert clean + 1 == len(verdicts) and len(verdicts) >= resident - 2
    assert m.value(S.SCRUB_PASSES.name) == 1
    assert m.value(S.SCRUB_COVERAGE.name) >= 0.9
    assert m.value(S.SCRUB_LAST_PASS.name) >= scrubber.started_at
    assert monitor.evidence.recent()  # an ordinary anomaly, with its evidence


def test_recompute_rate_stays_within_the_budget_measured() -> None:
    """Ten simulated minutes of ticks on a fake clock: the tokens the scrub recomputed per
    minute, measured by the budget itself, against the budget it was given."""
    _, monitor = _warm()
    now = [0.0]
    budget = 2_000.0
    settings = ScrubSettings(enabled=True, every_s=5.0, jitter_s=0.0, blocks_per_tick=50,
                             tokens_per_minute=budget, idle_s=0, seed=1)
    scrubber = scrubber_for(monitor, settings, clock=lambda: now[0])
    peak_minute = 0
    for _ in range(120):  # 10 minutes, one tick every 5 s
        scrubber.tick()
        peak_minute = max(peak_minute, scrubber.budget.last_minute())
        now[0] += settings.every_s
    measured = scrubber.budget.measured_per_minute()
    print(f"\nscrub recompute: measured {measured:.0f} tokens/min over 10 min "
          f"(peak minute {peak_minute}) vs budget {budget:.0f} tokens/min")
    assert measured <= budget
    assert measured >= 0.5 * budget  # the budget is used, not just respected
    largest_block = max(p for _, _, p in monitor.stored.resident()) + 16
    assert peak_minute <= budget + scrubber.budget.capacity + largest_block
    assert monitor.metrics.value(S.SCRUB_SKIPPED.name, reason="budget") > 0


def test_budget_bucket_never_runs_ahead_of_its_rate() -> None:
    now = [0.0]
    b = RecomputeBudget.per_minute(600.0, capacity=50.0, clock=lambda: now[0])  # 10 tokens/s
    spent = 0
    for _ in range(1000):
        if b.allows(30):
            b.spend(30)
            spent += 30
        now[0] += 0.1
    assert spent <= 50 + 30 + 10 * 100  # one bucket + one block + rate x 100 s


def test_a_tick_is_skipped_under_load() -> None:
    engine, monitor = _warm(replace(QUIET, scrub=True))
    scrubber = monitor.scrubber
    assert scrubber is not None
    # A full batch waiting for a slot: the adapter's busy() (resolved at attach) says so.
    engine.stats["submitted"] += engine.config.max_running
    assert scrubber.tick() == []
    assert monitor.metrics.value(S.SCRUB_SKIPPED.name, reason="load") == 1
    engine.stats["submitted"] -= engine.config.max_running
    assert scrubber.tick()


def test_blocks_near_an_anomaly_and_back_from_a_tier_jump_the_queue() -> None:
    engine, monitor = _warm(replace(QUIET, scrub=True, scrub_blocks_per_tick=1))
    scrubber = monitor.scrubber
    assert scrubber is not None
    resident = [b for _, b, _ in monitor.stored.resident()]
    loaded = resident[len(resident) // 2]
    scrubber.on_tier(0, loaded, TierState.LOADED)
    scrubber.on_tier(0, resident[0], TierState.OFFLOADING)  # not a load: no priority
    first = scrubber.tick()
    assert [v.sample.refs[0].block_id for v in first] == [loaded]
    bad = _cached_deep_block(engine)
    engine.pool.value[0, bad] = 0.0
    while True:  # scrub until the bad block is found
        verdicts = scrubber.tick()
        if any(v.findings for v in verdicts):
            break
    nxt = scrubber.tick()[0].sample.refs[0].block_id
    chain = scrubber.adapter.scrub_hit(0, nxt)
    near = abs(nxt - bad) <= 2 or (chain is not None and bad in chain.blocks[0])
    assert near or nxt in {int(b) for v in verdicts for b in v.sample.hit.blocks[0]}


def test_replicas_scrub_in_different_orders() -> None:
    _, monitor = _warm()

    def order(seed: int) -> list[int]:
        s = scrubber_for(monitor, ScrubSettings(enabled=True, idle_s=0, blocks_per_tick=6,
                                            tokens_per_minute=1e9, seed=seed))
        return [v.sample.refs[0].block_id for v in s.tick()]

    assert order(1) == order(1)
    assert order(1) != order(2)


def test_blocks_seen_in_a_sampled_hit_are_left_to_the_hit_path() -> None:
    _engine, monitor = _warm(replace(QUIET, sample_every=1, scrub=True, scrub_idle_s=3600))
    scrubber = monitor.scrubber
    assert scrubber is not None
    scrubber.run_pass()
    assert monitor.metrics.value(S.SCRUB_SKIPPED.name, reason="recently_hit") > 0


def test_without_the_capability_nothing_is_scrubbed_and_it_is_counted() -> None:
    _engine, monitor = _warm()

    class Plain:  # the reference adapter minus scrub_hit
        def __init__(self, inner: ReferenceAdapter) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            if name == "scrub_hit":
                raise AttributeError(name)
            return getattr(self.inner, name)

    monitor.adapter = Plain(monitor.adapter)  # type: ignore[assignment]
    s = scrubber_for(monitor, ScrubSettings(enabled=True, idle_s=0, tokens_per_minute=1e9))
    assert s.tick() == []
    assert monitor.metrics.value(S.SCRUB_SKIPPED.name, reason="unsupported") > 0


@pytest.mark.parametrize("field,value", [("scrub_every_s", 0), ("scrub_blocks_per_tick", 0),
                                         ("scrub_tokens_per_minute", -1)])
def test_bad_settings_are_refused_naming_the_key(field: str, value: float) -> None:
    engine = ReferenceEngine(EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match=field):
        Monitor(ReferenceAdapter(engine), replace(QUIET, scrub=True, **{field: value}))


def test_the_scheduled_scrub_finds_it_too_and_stops_cleanly() -> None:
    """The real APScheduler job (jitter, max_instances=1, coalesce): waits for the finding
    (up to 30 s on a loaded machine), asserts nothing about how long it took."""
    import time

    engine, monitor = _warm(replace(QUIET, scrub=True, scrub_every_s=0.05,
                                    scrub_jitter_s=0.02, dispatch="queued"))
    bad = _cached_deep_block(engine)
    engine.pool.value[1, bad, 1, 0] -= 0.5
    monitor.start()
    try:
        scrubber = monitor.scrubber
        assert scrubber is not None and scrubber.alive
        deadline = time.monotonic() + 30
        while _anomalies(monitor) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        monitor.stop()
    assert not scrubber.alive
    assert monitor.metrics.value(S.ANOMALIES.name, group="full",
                                 kind="recompute_mismatch") == 1
    assert monitor.metrics.value(S.SCRUB_RECOMPUTE_TOKENS.name) > 0


def test_the_overdue_alert_takes_its_threshold_from_signals() -> None:
    from alerts.rules import MixinConfig, alert_rules

    rule = next(a for a in alert_rules(MixinConfig()) if a.name == "KVSidecarScrubOverdue")
    assert f"> {S.THRESHOLDS.scrub_pass_overdue_seconds:g})" in rule.expr
    assert S.SCRUB_LAST_PASS.name in rule.expr
