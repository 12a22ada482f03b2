"""Issue acceptance through the demo: each allocator fault shows its invariant or trend firing,
no later than the first sampled content anomaly, and how long after the fault started."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
from kvtestbed.demo import DemoOptions, format_summary, run_demo

from sidecar.cli.main import main
from sidecar.signals import THRESHOLDS, InvariantKind

SUMMARY_KEYS = {"invariant_violations", "leak_suspected", "allocation_failure_rate",
                "usage_ratio", "fragmentation_ratio", "first_invariant_violation_request",
                "first_content_anomaly_request", "fault_start_request",
                "detection_delay_requests"}


@cache
def demo(fault: str) -> dict[str, Any]:
    return run_demo(DemoOptions(fault=fault, port=0, progress=False))


@pytest.mark.parametrize("fault", ["boundary-off-by-one", "premature-free"])
def test_invariant_fires_before_the_first_content_anomaly(fault: str) -> None:
    s = demo(fault)
    assert set(s) >= SUMMARY_KEYS
    first_violation = s["first_invariant_violation_request"]
    first_anomaly = s["first_content_anomaly_request"]
    assert first_violation is not None and first_anomaly is not None
    assert s["fault_start_request"] <= first_violation <= first_anomaly
    assert s["detection_delay_requests"]["invariant"] == first_violation - s[
        "fault_start_request"]
    assert set(s["invariant_violations"]) <= {k.value for k in InvariantKind}
    expected = {"boundary-off-by-one": "free_while_indexed",
                "premature-free": "free_while_held"}[fault]
    assert s["invariant_violations"].get(expected, 0) > 0
    assert "CAUGHT: the block allocator broke its invariants" in format_summary(s)


def test_leak_raises_the_leak_signal() -> None:
    s = demo("leak")
    assert s["leak_suspected"] is True and s["leak_suspected_blocks"] > 0
    assert s["first_leak_suspected_request"] >= s["fault_start_request"]
    assert s["detection_delay_requests"]["leak"] is not None
    assert s["invariant_violations"].get("leaked_reference", 0) > 0
    assert "and leaks blocks" in format_summary(s)


def test_fragmentation_fails_allocations_while_usage_stays_moderate() -> None:
    s = demo("fragmentation")
    t = THRESHOLDS
    assert s["allocation_failure_rate"] > t.allocation_failure_rate
    assert s["max_fragmentation_ratio"] > t.fragmentation_ratio
    assert s["max_usage_ratio"] < t.usage_ratio
    assert s["allocator_thresholds_exceeded"] == ["allocation_failure_rate",
                                                  "fragmentation_ratio"]
    assert s["invariant_violations"] == {}  # contiguity is a policy, not a broken invariant


def test_clean_demo_is_clean() -> None:
    s = demo("none")
    assert s["invariant_violations"] == {} and s["invariant_checks"] > 100
    assert not s["leak_suspected"] and s["first_invariant_violation_request"] is None
    assert s["allocation_failure_rate"] == 0.0 and s["allocator_thresholds_exceeded"] == []
    assert s["fault_start_request"] is None
    assert format_summary(s).endswith("the allocator kept its invariants")
    assert "fault started at request        never" in format_summary(s)  # not "None"


def test_cli_json_carries_the_allocator_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--fault", "leak", "--requests", "80", "--port", "0", "--quiet",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert set(s) >= SUMMARY_KEYS
    assert isinstance(s["invariant_violations"], dict) and s["leak_suspected"] is True
