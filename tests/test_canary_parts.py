"""The canary's pieces on their own: the comparison (divergence, tolerance), the pair and
metrics audits, the rate limit, and the alert rule that pages on the audit's lies only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sidecar import signals as S
from sidecar.canary.client import Completion
from sidecar.canary.compare import Tolerance, divergence
from sidecar.canary.hit_audit import MetricsAudit, audit_pair, counter_sum
from sidecar.canary.load import RateLimit
from sidecar.canary.probes import PairResult


# ---------------------------------------------------------------- pieces
def _c(tops: list[dict[str, float]], cached: int | None = 0) -> Completion:
    return Completion([max(t, key=t.__getitem__) for t in tops], tops, 9, cached, 0.01)


def test_divergence_bounds_missing_tokens_and_stops_at_a_different_token() -> None:
    a = _c([{"x": -1.0, "y": -2.0}, {"p": -0.5, "q": -3.0}, {"z": -0.1}])
    b = _c([{"x": -1.0, "w": -2.5}, {"q": -0.4, "p": -3.0}, {"z": -9.0}])
    d = divergence(a, b)
    # pos 0: y missing in b -> at least -2.0 - (-2.5) = 0.5; pos 1: tokens differ, |q| 2.6;
    # pos 2 is never compared (a different text follows).
    assert d.value == pytest.approx(2.6) and d.position == 1
    assert d.token_diverged_at == 1 and d.compared == 2


def test_tolerance_floor_ceiling_and_calibration() -> None:
    t = Tolerance("float32", calibration=2)
    assert t.value == t.ceiling  # pair mode: nothing trusted yet
    t.learn(1.0)  # above the ceiling: an anomaly, never noise
    assert t.noise == []
    t.learn(1e-6)
    t.learn(2e-5)
    assert t.calibrated and t.value == pytest.approx(2e-4)  # 10 x noise
    t.learn(5e-3)  # calibrated: ignored
    assert t.value == pytest.approx(2e-4)
    s = Tolerance("bfloat16", calibration=8, trusted=True)
    s.learn(0.0)
    assert s.value == s.floor == S.CANARY_THRESHOLDS.floor_for("bfloat16")


def test_pair_audit_kinds() -> None:
    hit = _c([{"a": -1.0}], cached=8)  # 9 tokens, block 4: the repeat hits 8
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), hit), 4).mismatches == ()
    assert audit_pair(PairResult(9, _c([{"a": -1.0}], 4), hit), 4).mismatches == (
        S.AuditKind.PHANTOM_HIT,)
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), _c([{"a": -1.0}], 9)), 4
                      ).mismatches == (S.AuditKind.OVER_REPORTED,)
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), _c([{"a": -1.0}], 0)), 4
                      ).mismatches == (S.AuditKind.UNDER_REPORTED,)
    assert audit_pair(PairResult(9, _c([{"a": -1.0}]), _c([{"a": -1.0}], None)), 4
                      ).mismatches == ()


def test_metrics_audit_compares_one_tick_late() -> None:
    a = MetricsAudit()
    assert not a.tick(100.0)
    a.add_proven(32)
    assert not a.tick(100.0)  # the counter may trail the answers by one tick
    assert a.tick(100.0)  # still short one tick later: a mismatch
    assert not a.tick(140.0)
    assert not a.tick(None)
    assert counter_sum('# HELP x\nvllm:prefix_cache_hits_total{a="1"} 3\n'
                       'vllm:prefix_cache_hits_total{a="2"} 4.0\n') == 7.0
    assert counter_sum("other 1\n") is None


def test_rate_limit_is_a_fraction_of_the_server_load_minus_its_own() -> None:
    now = [0.0]
    r = RateLimit(fraction=0.1, min_rate=0.5, max_rate=5.0, clock=lambda: now[0])
    assert r.allowed_rate == 5.0  # no server metrics yet: the fixed maximum
    r.observe_server("vllm:request_success_total 100\n")
    now[0] = 10.0
    r.sent(20)
    r.observe_server("vllm:request_success_total 420\n")  # 300 others in 10 s
    assert r.server_rate == pytest.approx(30.0) and r.allowed_rate == pytest.approx(3.0)
    assert r.pause_for(3) == pytest.approx(1.0)
    now[0] = 20.0
    r.observe_server("vllm:request_success_total 421\n")
    assert r.allowed_rate == 0.5  # idle server: the floor
    r.observe_server(None)
    assert r.allowed_rate == 5.0


def test_hit_counter_alert_fires_on_lies_only() -> None:
    rules = (Path(__file__).resolve().parents[1] / "alerts" / "kv-sidecar.rules.yml").read_text()
    alert = rules.split("alert: KVCacheHitCounterMismatch")[1]
    alarm = re.search(r'kind=~"([^"]+)"', alert)
    assert alarm and alarm.group(1).split("|") == [k.value for k in S.AUDIT_ALARM_KINDS]
    assert S.AuditKind.UNDER_REPORTED.value not in alarm.group(1).split("|")  # evictions
