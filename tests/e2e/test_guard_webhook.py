"""The guard's webhook mode through the whole alert path: kv-sidecars with a fault ->
Prometheus scrapes them and evaluates the shipped rules (their real ``for:``) ->
Alertmanager routes with the shipped config -> the pager's webhooks, one of which is each
guard's ``/guard/alertmanager`` (with the guard's bearer token) -> the guard opens.

The sidecars are real and in-process: the reference engine with a ``zero-block`` fault (it
starts after 2 requests, every hit sampled, so the first anomaly comes within seconds), the
sidecar's Monitor and its /metrics server. Two fleets, told apart by their model label:

* ``solo-model``: 2 replicas, one faulty. Its per-replica page (no fleet page below 3
  replicas) opens the faulty replica's guard and leaves the clean replica's guard closed.
* ``fleet-model``: 3 replicas, 2 faulty (> half: ``KVCacheAnomalyFleetWide``, which the
  shipped Alertmanager config lets through alone, with no ``instance`` label). It opens
  every guard of the model, the clean replica's included.

Test-only: scrape and evaluation intervals 1s, Alertmanager group_wait 1s (the rules and
their ``for:`` are the shipped ones). Everything listens on 127.0.0.1 on free ports; the
Prometheus and Alertmanager processes are stopped by PID. About 75 s.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.demo import DemoOptions, sidecar_config
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

from alerts import fleet as fleet_rules
from alerts.rules import MixinConfig, alert_rules
from sidecar import signals as S
from sidecar.core.monitor import Monitor
from sidecar.export.server import SidecarServer
from sidecar.protect.breaker import BreakerSettings, State
from sidecar.protect.bypass_guard import BypassGuard, GuardConfig
from tests.canary_fake import FakeServer
from tests.e2e import live
from tests.e2e.test_fleet import stack_mod
from tests.promtools import require

pytestmark = pytest.mark.e2e
TOKEN = "am-guard-token"
FAULT = "zero-block"
SOLO, FLEET = "solo-model", "fleet-model"


class _Labelled(ReferenceAdapter):
    """The reference adapter under another model label (one process, two fleets)."""

    def __init__(self, engine: ReferenceEngine, model: str) -> None:
        super().__init__(engine)
        self._info = dataclasses.replace(self._info, model=model)


@dataclass
class Replica:
    model: str
    fault: str
    monitor: Monitor
    engine: ReferenceEngine
    server: SidecarServer
    first_anomaly: float | None = None  # wall clock of the first anomalous verdict
    guard: BypassGuard | None = None
    opened: float | None = None

    @property
    def instance(self) -> str:
        return self.server.url.removeprefix("http://")

    def anomalies(self) -> float:
        return float(self.monitor.metrics.value_sum(S.ANOMALIES.name))

    def drive(self, requests: int) -> None:
        """``requests`` of the chat workload (a faulty replica's first anomaly comes after
        about a dozen), its samples verified."""
        workload = ChatWorkload(WorkloadConfig(seed=0, conversations=8,
                                               block_size=self.engine.block_size))
        drive(self.engine, workload, max_requests=requests)
        self.monitor.drain(timeout_s=60)


def _replica(model: str, fault: str) -> Replica:
    # The tolerance from the fixed table: the shipped calibration profile is keyed by the
    # model's own name, and learning one would wait for 64 clean blocks.
    opts = DemoOptions(fault=fault, sample_every=1,
                       sidecar={"calibration_profile": "", "calibration_samples": 0})
    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype="float32", seed=0),
                                          num_blocks=opts.num_blocks, fault=fault,
                                          kv_digest=True))
    if fault != "none":
        engine.fault.start_after = 2  # type: ignore[union-attr]
    monitor = Monitor(_Labelled(engine, model), sidecar_config(opts))
    engine.sink = monitor
    monitor.start()
    server = SidecarServer(monitor.metrics.registry, monitor.summary).start()
    return Replica(model, fault, monitor, engine, server)


@dataclass
class Chain:
    alertmanager: str
    prometheus: str
    webhook: Any
    replicas: dict[str, Replica] = field(default_factory=dict)


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[Chain]:
    prom_bin = require("prometheus")
    am_bin = require("prometheus-alertmanager", "alertmanager")
    plan = {"solo-faulty": (SOLO, FAULT), "solo-clean": (SOLO, "none"),
            "fleet-faulty-0": (FLEET, FAULT), "fleet-faulty-1": (FLEET, FAULT),
            "fleet-clean": (FLEET, "none")}
    replicas: dict[str, Replica] = {}
    webhook = stack_mod.WebhookReceiver()
    procs: list[Any] = []
    with FakeServer() as upstream:
        try:
            for name, (model, fault) in plan.items():
                r = replicas[name] = _replica(model, fault)
                r.guard = BypassGuard(GuardConfig(
                    upstream=("127.0.0.1", upstream.port), model=model, instance=r.instance,
                    verify_every=0, token=TOKEN,
                    breaker=BreakerSettings(hold_s=3600))).start()
            cfg = stack_mod.alertmanager_config(webhook.url, "1s", "2s")
            pager = next(r for r in cfg["receivers"] if r["name"] == "pager")
            for r in replicas.values():
                assert r.guard is not None
                pager["webhook_configs"].append({
                    "url": r.guard.url + "/guard/alertmanager", "send_resolved": True,
                    "http_config": {"authorization": {"type": "Bearer",
                                                      "credentials": TOKEN}}})
            am_port, prom_port = stack_mod.free_port(), stack_mod.free_port()
            am = f"{stack_mod.HOST}:{am_port}"
            with stack_mod.stopping(procs):
                procs.append(stack_mod.alertmanager_process(tmp_path, am_bin, am_port,
                                                            cfg).start())
                procs.append(stack_mod.prometheus_process(
                    tmp_path, prom_bin, prom_port, stack_mod.prometheus_config(
                        [r.instance for r in replicas.values()], am, "1s")).start())
                stack_mod.wait_http(f"http://{am}/-/ready", 60, procs[0])
                prometheus = f"http://{stack_mod.HOST}:{prom_port}"
                stack_mod.wait_http(f"{prometheus}/-/ready", 60, procs[1])
                yield Chain(f"http://{am}", prometheus, webhook, replicas)
        finally:
            for r in replicas.values():
                if r.guard is not None:
                    r.guard.stop()
                r.monitor.stop()
                r.server.stop()
            webhook.stop()


def _for_s(alertname: str) -> float:
    rules = [*alert_rules(MixinConfig()), *fleet_rules.alert_rules(MixinConfig())]
    rule = next(a for a in rules if a.name == alertname)
    return float(rule.for_[:-1]) * {"s": 1, "m": 60, "h": 3600}[rule.for_[-1]]


def _watch(replicas: list[Replica], stop: threading.Event) -> None:
    """Note when each guard opened (the breaker keeps no clock of its own), every 50 ms."""
    while not stop.wait(0.05):
        for r in replicas:
            assert r.guard is not None
            if r.opened is None and r.guard.breaker.current() is State.OPEN:
                r.opened = time.time()


def test_pages_through_prometheus_and_alertmanager_open_the_guards_they_concern(
        chain: Chain) -> None:
    rs = chain.replicas
    live.wait_for("Prometheus scraping every sidecar", 60, lambda: len(
        live.query(chain.prometheus, 'up{job="kv-sidecar"} == 1')) == len(rs))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(list(rs.values()), stop), daemon=True)
    watcher.start()
    try:
        for r in rs.values():
            r.drive(8 if r.fault == "none" else 24)  # clean replicas: clean verdicts
        for r in rs.values():
            assert (r.anomalies() > 0) is (r.fault != "none"), r.instance
            # the first anomalous verdict's time, from the sidecar's evidence record
            verdicts = [e["time"] for e in r.monitor.evidence.recent(10_000) if e.get("checks")]
            r.first_anomaly = min(verdicts) if verdicts else None
            assert (r.first_anomaly is not None) is (r.fault != "none"), r.instance
        solo, fleet = rs["solo-faulty"], [rs["fleet-faulty-0"], rs["fleet-faulty-1"]]
        instance_for, fleet_for = _for_s(S.ALERT_CONTENT_ANOMALY), \
            _for_s(S.ALERT_ANOMALY_FLEET_WIDE)
        live.wait_for("the guards of the paged replica and of the paged fleet to open",
                      max(instance_for, fleet_for) + 120,
                      lambda: all(rs[n].opened for n in ("solo-faulty", "fleet-faulty-0",
                                                         "fleet-faulty-1", "fleet-clean")))
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert rs["solo-clean"].anomalies() == 0 and rs["fleet-clean"].anomalies() == 0
    # The instance-labelled page opened only its own guard; the clean solo replica's
    # guard, same model, stays closed.
    assert rs["solo-clean"].guard is not None
    assert rs["solo-clean"].guard.breaker.current() is State.CLOSED
    pages = chain.webhook.alerts("/page")
    fleet_pages = [a for a in pages if a["labels"]["alertname"] == S.ALERT_ANOMALY_FLEET_WIDE]
    assert fleet_pages and all("instance" not in a["labels"] and
                               a["labels"]["model"] == FLEET for a in fleet_pages)
    assert {a["labels"].get("instance") for a in pages
            if a["labels"]["model"] == SOLO} == {solo.instance}
    for r in rs.values():
        assert r.guard is not None and r.guard.server.rejected.get(401) is None  # token sent
    assert solo.opened is not None and solo.first_anomaly is not None
    solo_s = solo.opened - solo.first_anomaly
    last_fleet_anomaly = max(r.first_anomaly or 0.0 for r in fleet)
    fleet_s = max(rs[n].opened or 0.0 for n in ("fleet-faulty-0", "fleet-faulty-1",
                                                "fleet-clean")) - last_fleet_anomaly
    # A page cannot come before the rule's for: has run out (it did go through the rule).
    assert solo_s >= instance_for and fleet_s >= fleet_for
    print(f"\nguard webhook chain: first anomaly -> guard open {solo_s:.1f} s "
          f"(instance page, for: {instance_for:g} s); fleet's second faulty replica's first "
          f"anomaly -> every fleet guard open {fleet_s:.1f} s (fleet page, for: "
          f"{fleet_for:g} s); scrape/eval 1 s, group_wait 1 s")
