"""Protective actions (sidecar/protect/actions.py) on the real reference engine: quarantine makes a
corrupted entry one anomaly instead of one per later hit; the circuit breaker takes the hit
rate to 0 after K anomalies and brings it back after M clean probes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request, Result

from sidecar import signals as S
from sidecar.checks.verifier import Verdict
from sidecar.core.monitor import Monitor, SidecarConfig
from tests.limits import DETECTION_TIMEOUT_S

BS = 16
# Every hit verified inline, every full block of it: a later hit of a bad block is seen.
EVERY_HIT = SidecarConfig(sample_every=1, blocks_per_sample=64, dispatch="inline",
                          allocator_every_s=0, recompute_tokens_per_s=0, scrub_idle_s=0,
                          scrub_blocks_per_tick=1, scrub_tokens_per_minute=1e9, scrub_seed=3,
                          adapter_timeout_s=DETECTION_TIMEOUT_S)


def _setup(config: SidecarConfig) -> tuple[ReferenceEngine, Monitor]:
    engine = ReferenceEngine(EngineConfig(num_blocks=128))
    monitor = Monitor(ReferenceAdapter(engine), config)
    engine.sink = monitor
    return engine, monitor


def _prompt(i: int, blocks: int = 3) -> list[int]:
    return [(7 * i + 3 * t) % 250 + 1 for t in range(blocks * BS + 5)]


def _serve(engine: ReferenceEngine, prompt: list[int]) -> Result:
    return engine.serve(Request(list(prompt), max_new_tokens=2))


def _anomalies(monitor: Monitor) -> float:
    return monitor.metrics.value_sum(S.ANOMALIES.name)


def _corrupt(engine: ReferenceEngine, prompt: list[int], index: int) -> int:
    """Zero the cached block at ``index`` of the prompt's chain (found through a hit)."""
    hit = engine.pool.lookup([h for h in _hashes(engine, prompt)])
    b = hit[index]
    engine.pool.key[:, b] = 0.0
    engine.pool.value[:, b] = 0.0
    return b


def _hashes(engine: ReferenceEngine, prompt: list[int]) -> list[bytes]:
    kf = engine.key_fields(Request(list(prompt)))
    out: list[bytes] = []
    engine._chain(0, prompt, kf, (len(prompt) - 1) // BS, out)
    return out


@pytest.mark.parametrize("quarantine,expected", [(True, 1), (False, 4)])
def test_quarantine_makes_a_corrupted_entry_one_anomaly(quarantine: bool,
                                                        expected: int) -> None:
    engine, monitor = _setup(replace(EVERY_HIT, quarantine=quarantine))
    prompt = _prompt(1)
    _serve(engine, prompt)
    bad = _corrupt(engine, prompt, 1)
    results = [_serve(engine, prompt) for _ in range(4)]
    assert _anomalies(monitor) == expected
    m = monitor.metrics
    assert m.value(S.ACTION_ENABLED.name, action="quarantine") == int(quarantine)
    if quarantine:
        assert m.value(S.QUARANTINED.name, result="evicted") == 1
        assert engine.pool.blocks[bad].block_hash is None
        # the first later request still hit the bad block (that is how it was found), the
        # next recomputed it from there on, and the ones after hit the clean copy
        hits = [r.hit_tokens for r in results]
        assert hits[0] == 3 * BS and hits[1] == BS and hits[2:] == [3 * BS, 3 * BS]
    else:
        assert m.value(S.QUARANTINED.name, result="evicted") == 0


def test_breaker_drops_the_hit_rate_to_zero_and_recovers_after_m_clean_probes() -> None:
    k, probes = 2, 3
    engine, monitor = _setup(replace(EVERY_HIT, breaker=True, quarantine=True,
                                     breaker_anomalies=k, breaker_probes=probes))
    breaker = monitor.actions.breaker
    scrubber = monitor.scrubber
    assert breaker is not None and scrubber is not None and not scrubber.settings.enabled
    prompts = [_prompt(i) for i in range(6)]
    for p in prompts:
        _serve(engine, p)
    warm = [_serve(engine, p) for p in prompts]
    assert all(r.hit_tokens > 0 for r in warm)
    for p in prompts[:3]:  # a burst of corruption
        _corrupt(engine, p, 0)
    tripped = [_serve(engine, p) for p in prompts[:3]]
    assert breaker.open and breaker.trips == 1 and monitor.hits_allowed is False
    assert _anomalies(monitor) == k  # the third request was served as a miss
    assert tripped[2].hit_tokens == 0
    m = monitor.metrics
    assert m.value(S.BREAKER_OPEN.name) == 1
    open_results = [_serve(engine, p) for p in prompts]
    assert sum(r.hit_tokens for r in open_results) == 0  # hit rate 0 while open
    probe_log: list[Verdict] = []  # the scrub is off, yet probes run while open
    for _ in range(200):
        if not breaker.open:
            break
        probe_log.extend(scrubber.tick())
    assert not breaker.open, "the breaker never closed"
    decided = [v for v in probe_log if v.verified]
    assert len(decided) >= probes
    trailing = next((i for i, v in enumerate(reversed(decided)) if v.findings), len(decided))
    assert trailing == probes  # closed by exactly M clean probes in a row, not before
    assert m.value(S.BREAKER_PROBES.name, result="clean") >= probes
    assert m.value(S.BREAKER_OPEN.name) == 0 and monitor.hits_allowed is True
    recovered = [_serve(engine, p) for p in prompts]
    assert all(r.hit_tokens > 0 for r in recovered)  # hits are served again


def test_breaker_count_starts_over_on_an_anomalous_probe() -> None:
    engine, monitor = _setup(replace(EVERY_HIT, breaker=True, breaker_anomalies=1,
                                     breaker_probes=2))
    breaker = monitor.actions.breaker
    assert breaker is not None
    prompt = _prompt(9)
    _serve(engine, prompt)
    _corrupt(engine, prompt, 2)
    _serve(engine, prompt)
    assert breaker.open
    _corrupt(engine, _prompt(9), 0)  # still bad, not quarantined: probes keep failing
    scrubber = monitor.scrubber
    assert scrubber is not None
    for _ in range(6):
        scrubber.tick()
    assert breaker.open
    assert monitor.metrics.value(S.BREAKER_PROBES.name, result="anomalous") >= 1


def test_actions_are_off_by_default_and_say_so() -> None:
    _engine, monitor = _setup(replace(EVERY_HIT))
    assert monitor.actions.breaker is None and monitor.actions.quarantine is None
    assert monitor.scrubber is None and monitor.hits_allowed is True
    for action in ("quarantine", "breaker"):
        assert monitor.metrics.value(S.ACTION_ENABLED.name, action=action) == 0


def test_a_failing_evict_is_counted_never_raised() -> None:
    engine, monitor = _setup(replace(EVERY_HIT, quarantine=True))

    def broken(group_id: int, block_ids: object) -> int:
        raise RuntimeError("engine refused")
    monitor.actions.quarantine._evictor.evict = broken  # type: ignore[union-attr]
    prompt = _prompt(4)
    _serve(engine, prompt)
    _corrupt(engine, prompt, 0)
    _serve(engine, prompt)
    assert monitor.metrics.value(S.QUARANTINED.name, result="error") == 1
    assert _anomalies(monitor) == 1


def test_actions_demo_refuses_bad_input_with_exit_code_2(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    from sidecar.cli.main import main

    assert main(["actions-demo", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
    assert main(["actions-demo", "--scenario", "scrub", "--budget", "-5"]) == 2
