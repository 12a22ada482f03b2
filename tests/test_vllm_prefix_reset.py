"""The vLLM prefix-cache reset (sidecar/adapters/vllm/prefix_reset.py) against a local
stand-in for vLLM's dev endpoint: retried while requests hold blocks, rate-limited,
'unsupported' where the endpoint is absent, every outcome counted. The real endpoint is
exercised in tests/vllm/test_guard.py."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from sidecar import signals as S
from sidecar.adapters.vllm.prefix_reset import PrefixCacheReset, ResetSettings
from sidecar.export.metrics import Metrics
from tests.stub_http import StubHandler, StubServer


class FakeVllm(StubServer):
    def __init__(self, busy_for: int, dev_mode: bool = True) -> None:
        self.busy_for, self.calls = busy_for, 0
        outer = self

        class H(StubHandler):
            def do_POST(self) -> None:
                if not dev_mode or self.path != "/reset_prefix_cache":
                    self.send_error(404)
                    return
                outer.calls += 1
                self.reply(200, json.dumps({"success": outer.calls > outer.busy_for}).encode())

        super().__init__(H)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics("vllm", "tiny")


def test_retries_while_blocks_are_held_then_resets(metrics: Metrics) -> None:
    with FakeVllm(busy_for=3) as fake:
        r = PrefixCacheReset(fake.url, ResetSettings(backoff_s=0.001), metrics)
        entry = r.reset_now("page")
        assert entry["result"] == "reset" and entry["attempts"] == 4 and fake.calls == 4
        assert metrics.value(S.PREFIX_CACHE_RESETS.name, result="reset") == 1


def test_gives_up_as_busy_after_its_attempts(metrics: Metrics) -> None:
    with FakeVllm(busy_for=100) as fake:
        r = PrefixCacheReset(fake.url, ResetSettings(attempts=3, backoff_s=0.001), metrics)
        assert r.reset_now()["result"] == "busy" and fake.calls == 3
        assert metrics.value(S.PREFIX_CACHE_RESETS.name, result="busy") == 1


def test_without_dev_mode_it_says_unsupported_once(metrics: Metrics) -> None:
    with FakeVllm(busy_for=0, dev_mode=False) as fake:
        r = PrefixCacheReset(fake.url, ResetSettings(backoff_s=0.001), metrics)
        assert r.reset_now() == {**r.history[0], "result": "unsupported", "attempts": 1}


def test_requests_are_rate_limited(metrics: Metrics) -> None:
    now = [0.0]
    with FakeVllm(busy_for=0) as fake:
        r = PrefixCacheReset(fake.url, ResetSettings(min_interval_s=60, backoff_s=0.001),
                             metrics, clock=lambda: now[0])
        assert r.request()
        ev = threading.Event()
        for _ in range(400):
            if r.history:
                break
            ev.wait(0.05)
        assert r.history[0]["result"] == "reset"
        now[0] = 59.0
        assert not r.request()
        assert r.history[-1]["result"] == "rate_limited"
        assert metrics.value(S.PREFIX_CACHE_RESETS.name, result="rate_limited") == 1


@pytest.mark.parametrize("bad", [dict(min_interval_s=float("nan")), dict(attempts=0),
                                 dict(backoff_s=float("inf"))])
def test_settings_are_finite_and_bounded(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ResetSettings(**bad)


def test_vllm_serve_flag_wires_an_anomalous_verdict_to_a_reset(metrics: Metrics) -> None:
    """`vllm serve --reset-prefix-cache`: the Monitor's verdict listener asks for a reset on
    an anomalous verdict only; without --engine-url it refuses to start."""
    from types import SimpleNamespace

    from sidecar.adapters.vllm.cli import _prefix_reset, parser

    with FakeVllm(busy_for=0) as fake:
        args = parser().parse_args(["serve", "--model", "m", "--dtype", "float32",
                                    "--block-size", "32", "--reset-prefix-cache",
                                    "--engine-url", fake.url])
        sc = SimpleNamespace(monitor=SimpleNamespace(verdict_listeners=[]), metrics=metrics)
        reset = _prefix_reset(args, sc)
        assert reset is not None and len(sc.monitor.verdict_listeners) == 1
        listener = sc.monitor.verdict_listeners[0]
        listener(SimpleNamespace(findings=[]))  # clean: nothing
        assert not reset.history and fake.calls == 0
        listener(SimpleNamespace(findings=["zeros"]))
        ev = threading.Event()
        for _ in range(400):
            if reset.history:
                break
            ev.wait(0.05)
        assert reset.history[0]["result"] == "reset" and fake.calls == 1
    off = parser().parse_args(["serve", "--model", "m", "--dtype", "float32",
                               "--block-size", "32"])
    assert _prefix_reset(off, None) is None
    no_url = parser().parse_args(["serve", "--model", "m", "--dtype", "float32",
                                  "--block-size", "32", "--reset-prefix-cache"])
    with pytest.raises(SystemExit, match="engine-url"):
        _prefix_reset(no_url, None)
