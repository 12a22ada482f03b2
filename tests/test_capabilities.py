"""Optional capabilities are declared (sidecar.core.capabilities), checked when a Monitor
attaches, reported (log + signal) and, when wrongly shaped, refused so the Monitor runs
without them instead of failing later in a verifier thread."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine

from sidecar import signals as S
from sidecar.core.capabilities import CAPABILITIES, declared
from sidecar.core.conformance import check_adapter, check_protocol
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, Hit
from sidecar.core.sampling import UniformSampler
from tests.toy import BS, ToyAdapter, ToyEngine

INLINE = SidecarConfig(sample_every=1, dispatch="inline", allocator_every_s=0, burst_hits=0)


def _attach(adapter_cls: type, sampler: object = None) -> tuple[ToyEngine, Monitor]:
    engine = ToyEngine(sink=None)
    monitor = Monitor(adapter_cls(engine), INLINE, sampler=sampler)  # type: ignore[arg-type]
    engine.sink = monitor
    return engine, monitor


def _problems(monitor: Monitor, capability: str) -> float:
    return monitor.metrics.value(S.CAPABILITY_PROBLEMS.name, capability=capability)


class MisspeltName(ToyAdapter):
    refrence_kind = "engine"  # meant reference_kind


class MisspeltValue(ToyAdapter):
    reference_kind = "engin"  # not a reference kind


class WrongArityCapture(ToyAdapter):
    def capture(self, hit: Hit) -> list[BlockKV]:  # forgot refs
        raise AssertionError("a refused capture is never called")


class GoodCapture(ToyAdapter):
    reference_kind = "engine"

    def capture(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return self.read(hit, refs)


def test_a_misspelt_capability_name_is_reported_on_attach(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.core.attach"):
        _, monitor = _attach(MisspeltName)
    found = monitor.capabilities.problems["reference_kind"]
    assert any("'refrence_kind'" in p and "did you mean 'reference_kind'" in p for p in found)
    assert _problems(monitor, "reference_kind") == 1
    assert "reference_kind" in caplog.text and "refrence_kind" in caplog.text
    assert monitor.verifier.reference_kind == "independent"  # nothing to take: the default


def test_a_misspelt_reference_kind_value_is_refused_naming_it(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.core.attach"):
        _, monitor = _attach(MisspeltValue)
    assert "reference_kind" in monitor.capabilities.refused
    assert any("'engin'" in p for p in monitor.capabilities.problems["reference_kind"])
    assert "reference_kind" in caplog.text and "refused" in caplog.text
    assert _problems(monitor, "reference_kind") == 1
    assert monitor.metrics.value(S.CAPABILITY_IN_USE.name, capability="reference_kind") == 0


def test_a_wrong_arity_capture_is_refused_and_the_monitor_runs_without_it(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="sidecar.core.attach"):
        engine, monitor = _attach(WrongArityCapture)
    assert "capture" in monitor.capabilities.refused and monitor._capture is None
    assert any("capture()" in p for p in monitor.capabilities.problems["capture"])
    assert _problems(monitor, "capture") >= 1
    warnings = [r for r in caplog.records if "capture" in r.getMessage()]
    assert len(warnings) == 1  # logged once, at attach
    prompt = list(range(3 * BS))
    engine.serve(prompt)
    engine.serve(prompt)  # a sampled hit: verified by reading, no hook error later
    assert monitor.metrics.value(S.VERIFIED.name, group="0") > 0
    assert monitor.metrics.value(S.HOOK_ERRORS.name, hook="capture") == 0
    assert len([r for r in caplog.records if "capture" in r.getMessage()]) == 1


def test_a_conforming_capability_is_taken_and_exported() -> None:
    _, monitor = _attach(GoodCapture)
    caps = monitor.capabilities
    assert caps.problems == {} and caps.refused == frozenset()
    assert monitor._capture is not None and monitor.verifier.reference_kind == "engine"
    assert monitor.metrics.value(S.CAPABILITY_IN_USE.name, capability="capture") == 1
    assert monitor.metrics.value(S.CAPABILITY_IN_USE.name, capability="busy") == 0
    assert _problems(monitor, "capture") == 0


class BadObserver(UniformSampler):
    def observe_store(self) -> None:  # wrong signature: no block
        raise AssertionError("never called")


def test_a_sampler_capability_with_a_wrong_signature_is_refused() -> None:
    engine, monitor = _attach(ToyAdapter, BadObserver(1))
    assert "observe_store" in monitor.capabilities.refused
    assert monitor._sampler_store is None
    engine.serve(list(range(2 * BS)))  # stores: no hook error from the refused observer
    monitor.journal.drain()
    assert monitor.metrics.value(S.HOOK_ERRORS.name, hook="on_store") == 0


def test_the_reference_adapter_offers_its_capabilities_cleanly() -> None:
    engine = ReferenceEngine(EngineConfig(num_blocks=16))
    monitor = Monitor(ReferenceAdapter(engine), INLINE)
    caps = monitor.capabilities
    assert caps.problems == {}
    assert {"capture", "busy", "block_tables", "scrub_hit", "evict"} <= caps.in_use


@pytest.mark.parametrize("cls", [MisspeltName, MisspeltValue, WrongArityCapture])
def test_check_adapter_names_the_capability(cls: type) -> None:
    problems = check_adapter(cls(ToyEngine(sink=None)))
    assert problems and all(cls.__name__ in p for p in problems)


def test_every_capability_is_declared_once_with_its_protocol() -> None:
    names = [(c.owner, c.name) for c in CAPABILITIES]
    assert len(names) == len(set(names))
    assert {c.name for c in declared("sampler")} == {"observe_store", "observe_free",
                                                      "observe_release"}
    # The sink's declared events are the Monitor's, with their signatures.
    for cap in declared("sink"):
        assert check_protocol(Monitor, cap.protocol) == [], cap.name
