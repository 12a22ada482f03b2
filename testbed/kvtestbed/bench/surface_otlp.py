"""OTLP surface of ``kv-sidecar bench reliability``: the push exporter against a receiver
that is down (connection refused), silent (accepts, never answers) or failing (HTTP 500).

The sidecar must keep verifying while each export fails: every export attempt returns
within the exporter's timeout (plus the SDK's retry budget) and is counted in
``failures`` and in the signal ``kvsidecar_otlp_export_failures_total`` with the
receiver's reason (connect, timeout, http) and no other; the verifier stays healthy and
verifications keep growing; span batches go
to the same dead receiver without reaching the verifier. Needs the ``otlp`` extra; without
it the surface reports itself skipped (and ``ok`` is false, so a run never passes quietly
without it).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

from kvtestbed.bench.hostile_http import Answer, HostileServer
from kvtestbed.bench.surfaces import SurfaceResult
from sidecar import signals as S

EXPORT_TIMEOUT_S = 0.3
# The reason each receiver's failures must be counted with (kvsidecar_otlp_export_failures_total)
REASONS = {"down": S.OtlpFailure.CONNECT, "silent": S.OtlpFailure.TIMEOUT,
           "500": S.OtlpFailure.HTTP}


@contextlib.contextmanager
def _receiver(kind: str) -> Iterator[str]:
    """A base URL whose receiver is ``down``, ``silent`` or ``500``."""
    if kind == "down":
        s = socket.socket()
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        try:
            yield f"http://127.0.0.1:{s.getsockname()[1]}"
        finally:
            s.close()
    elif kind == "silent":
        with HostileServer(lambda m, p, b: Answer(mode="silent")) as srv:
            yield srv.endpoint.removesuffix("/v1")
    else:
        with HostileServer(lambda m, p, b: Answer(status=500, body=b"boom")) as srv:
            yield srv.endpoint.removesuffix("/v1")


def otlp_endpoints(quick: bool, seed: int) -> SurfaceResult:
    exports = 5 if quick else 30
    res = SurfaceResult("otlp_endpoints", "OTLP receiver down / silent / HTTP 500 while "
                        "the reference engine serves -> OtlpPush", min_cases=3 * exports)
    try:
        from sidecar.core.extras import require

        require("otlp")
    except Exception as exc:  # the extra is missing: say so, and do not pass
        res.check(False, f"otlp extra not installed: {exc}")
        return res
    from kvtestbed.bench.floods import reference

    sdk_log = logging.getLogger("opentelemetry")
    level = sdk_log.level
    sdk_log.setLevel(logging.CRITICAL)  # the SDK logs each failed export: expected here
    engine, mon = reference(sample_every=1)
    mon.start()
    try:
        for kind in ("down", "silent", "500"):
            with _receiver(kind) as url:
                res.figures[kind] = _one(res, url, exports, engine, mon, REASONS[kind])
    finally:
        mon.stop()
        sdk_log.setLevel(level)
    return res


def _failures(mon: Any, reason: S.OtlpFailure) -> float:
    return float(mon.metrics.value(S.OTLP_EXPORT_FAILURES.name, signal="metrics",
                                   reason=reason.value))


def _one(res: SurfaceResult, url: str, exports: int, engine: Any, mon: Any,
         reason: S.OtlpFailure) -> dict[str, Any]:
    from kvtestbed.engines.engine import Request
    from sidecar.core.health import monitor_health
    from sidecar.export.otel_push import OtlpPush

    # Exports driven below, one by one; a short timeout keeps a dead receiver's wait short.
    push = OtlpPush(mon.metrics.registry, url, interval_s=3600,
                    timeout_s=EXPORT_TIMEOUT_S, metrics=mon.metrics)
    mon.reporter.listeners.append(push.spans.on_verdict)
    verified_before = mon.metrics.value_sum(S.VERIFIED.name)
    others = [r for r in S.OtlpFailure if r is not reason]
    others_before = {r.value: _failures(mon, r) for r in others}
    worst = 0.0
    try:
        for i in range(exports):
            engine.serve(Request(list(range(1, 33)) + [i % 7 + 40], max_new_tokens=1))
            before = push.metrics.failures
            signal_before = _failures(mon, reason)
            started = time.monotonic()
            res.cases += 1
            try:
                ok = push.metrics.export_once()
            except Exception:
                res.escaped += 1
                continue
            took = time.monotonic() - started
            worst = max(worst, took)
            if took > 30:  # the SDK's retries are bounded by its timeout; 30 s is a hang
                res.hangs += 1
            # answered: refused, counted on the exporter and as the signal, by its reason
            res.answered += (not ok) and push.metrics.failures == before + 1 \
                and _failures(mon, reason) == signal_before + 1
        mon.drain(30)
        verified = mon.metrics.value_sum(S.VERIFIED.name) - verified_before
        healthy = bool(monitor_health(mon)["ok"])
    finally:
        started = time.monotonic()
        push.shutdown()
        shutdown_s = time.monotonic() - started
        mon.reporter.listeners.remove(push.spans.on_verdict)
    res.check(healthy, f"{url}: the verifier stays healthy while exports fail")
    res.check(verified > 0, f"{url}: verifications continue while exports fail")
    res.check(shutdown_s < 60, f"{url}: shutdown returns ({shutdown_s:.1f} s)")
    other = {r.value: _failures(mon, r) - others_before[r.value] for r in others}
    res.check(not any(other.values()), f"{url}: only {reason.value} failures counted, "
                                       f"got {other}")
    return {"exports": push.metrics.exports, "failures": push.metrics.failures,
            "failures_signal": {reason.value: _failures(mon, reason)},
            "verified": verified, "worst_export_s": round(worst, 2),
            "shutdown_s": round(shutdown_s, 2)}
