"""A warning repeated every poll (an engine's /metrics unreachable) is logged once per
interval with the held-back count, while its counter counts every failure: at the shortest
poll period an unreachable vLLM wrote 60 lines in 3 s (outside check, stop 48)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.export.log_limit import LimitedWarning
from sidecar.export.metrics import Metrics


def test_one_line_per_interval_with_the_held_back_count(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    now = [100.0]
    warning = LimitedWarning(logging.getLogger("t"), 60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        for step in range(0, 130, 1):  # every second for 130 s
            now[0] = 100.0 + step
            warning.warn("down: %s", "x")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["down: x", "down: x (59 more like it in the last 60 s not logged)",
                     "down: x (59 more like it in the last 60 s not logged)"]


def test_the_vllm_bridge_counts_every_failed_read_and_logs_one(
        caplog: pytest.LogCaptureFixture) -> None:
    from sidecar.adapters.vllm.metrics_bridge import VllmMetricsBridge

    metrics = Metrics("vllm", "tiny", CollectorRegistry())

    def down() -> str:
        raise ConnectionRefusedError(111, "Connection refused")

    bridge = VllmMetricsBridge(metrics, down, block_size=16)
    with caplog.at_level(logging.WARNING, logger="sidecar.adapters.vllm.metrics_bridge"):
        for _ in range(50):
            assert bridge.poll() is None
    assert metrics.value(S.ENGINE_SCRAPE_ERRORS.name) == 50
    assert len([r for r in caplog.records if "reading vLLM metrics failed" in r.getMessage()]) == 1
