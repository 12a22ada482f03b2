"""The cache-bypass guard's breaker alone (sidecar/protect/breaker.py: its states, hold,
probes and probe errors, on a fake clock) and which Alertmanager pages concern a guard
(pages_for)."""

from __future__ import annotations

from typing import Any

import pytest

from sidecar import signals as S
from sidecar.protect.breaker import BreakerSettings, BypassBreaker, Route, Source, State
from sidecar.protect.bypass_guard import pages_for


def test_breaker_opens_on_one_anomaly_probes_after_the_hold_and_closes_after_m() -> None:
    now = [0.0]
    b = BypassBreaker(BreakerSettings(hold_s=10, probes=3, probe_every=2), clock=lambda: now[0])
    assert b.route() is Route.FORWARDED
    b.clean(Source.LOCAL, 5)  # clean verdicts while closed change nothing
    b.anomaly(Source.LOCAL)
    assert b.state is State.OPEN and {b.route() for _ in range(6)} == {Route.BYPASSED}
    now[0] = 9.9
    assert b.current() is State.OPEN
    now[0] = 10.0
    routes = [b.route() for _ in range(6)]
    assert b.state is State.HALF_OPEN
    assert routes.count(Route.PROBE) == 3 and routes.count(Route.BYPASSED) == 3
    b.clean(Source.LOCAL, 2)
    b.anomaly(Source.SIDECAR)  # an anomaly among the probes: open again, count restarts
    assert b.state is State.OPEN and b.clean_probes == 0
    now[0] = 20.0
    b.clean(Source.LOCAL, 2)
    assert b.state is State.HALF_OPEN and b.clean_probes == 2
    b.clean(Source.LOCAL)
    assert b.state is State.CLOSED
    assert [(a.value, t.value, s.value) for a, t, s in b.transitions] == [
        ("closed", "open", "local"), ("open", "half_open", "timer"),
        ("half_open", "open", "sidecar"), ("open", "half_open", "timer"),
        ("half_open", "closed", "probes")]


def test_breaker_reopens_after_k_probes_without_a_verdict() -> None:
    now = [0.0]
    b = BypassBreaker(BreakerSettings(hold_s=1, probes=2, probe_every=1, probe_errors=3),
                      clock=lambda: now[0])
    b.probe_failed()  # closed: nothing to reopen
    b.anomaly(Source.OPERATOR)
    now[0] = 1.0
    assert b.current() is State.HALF_OPEN
    b.probe_failed()
    b.clean(Source.LOCAL)
    b.probe_failed()
    assert b.state is State.HALF_OPEN
    b.probe_failed()
    assert b.state is State.OPEN and b.transitions[-1][2] is Source.PROBE_ERRORS
    assert b.current() is State.OPEN  # a fresh hold
    now[0] = 2.0
    assert b.current() is State.HALF_OPEN


@pytest.mark.parametrize("bad", [dict(hold_s=float("nan")), dict(hold_s=float("inf")),
                                 dict(hold_s=0), dict(probes=0), dict(probe_every=10**6)])
def test_breaker_settings_are_finite_and_bounded(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        BreakerSettings(**bad)


def test_alertmanager_pages_match_this_instance_or_the_fleet_of_its_model() -> None:
    def alert(name: str, status: str = "firing", **labels: str) -> dict[str, Any]:
        return {"status": status, "labels": {"alertname": name, **labels}}

    payload = {"alerts": [alert("KVCacheContentAnomaly", instance="other:9400"),
                          alert("KVCacheContentAnomaly", "resolved", instance="me:9400"),
                          alert("KVCacheHitRateLow", instance="me:9400")]}
    assert pages_for(payload, "me:9400", "tiny") == []
    payload["alerts"].append(alert("KVCacheContentAnomaly", instance="me:9400"))
    assert pages_for(payload, "me:9400", "tiny") == ["KVCacheContentAnomaly"]
    fleet = {"alerts": [alert("KVCacheAnomalyFleetWide", model="tiny")]}
    assert pages_for(fleet, "me:9400", "tiny") == ["KVCacheAnomalyFleetWide"]
    assert pages_for(fleet, "me:9400", "other-model") == []
    # the outside tester's: these were answered 200 {"opened": false}, now 400s
    ok = alert("KVCacheContentAnomaly", instance="me:9400")
    for bad in ([], {"alerts": "x"}, "x", None, {"alerts": ["firing"]}, {"alerts": [None]},
                {"alerts": [{"status": "firing", "labels": ["a"]}]},
                {"alerts": [{"status": 1, "labels": {}}]}, {"alerts": [ok, {"labels": {}}]}):
        with pytest.raises(ValueError):
            pages_for(bad, "me:9400", "tiny")


def test_a_localised_page_for_this_instance_opens_it() -> None:
    # The shipped Alertmanager inhibits the per-replica pages under Localised: it is the
    # only page a lone faulty replica sends, so it must open that replica's guard.
    page = {"alerts": [{"status": "firing", "labels": {
        "alertname": S.ALERT_ANOMALY_LOCALISED, "instance": "me:9400"}}]}
    assert pages_for(page, "me:9400", "tiny") == [S.ALERT_ANOMALY_LOCALISED]
    assert pages_for(page, "other:9400", "tiny") == []
    from alerts.fleet import LOCALISED, PER_REPLICA_PAGES
    assert LOCALISED == S.ALERT_ANOMALY_LOCALISED
    assert S.ALERT_CONTENT_ANOMALY in PER_REPLICA_PAGES


@pytest.mark.parametrize("labels", [{"alertname": ["KVCacheContentAnomaly"]},
                                    {"alertname": "KVCacheContentAnomaly", "instance": 1},
                                    {"alertname": {"a": 1}, "instance": "me:9400"}])
def test_non_string_label_values_are_a_malformed_payload(labels: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="labels"):
        pages_for({"alerts": [{"status": "firing", "labels": labels}]}, "me:9400", "tiny")
