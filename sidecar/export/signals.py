"""OTLP push health's own signals; registered by the push where it runs.
"""

from __future__ import annotations

import enum

from sidecar.core.signal_types import C, Signal
from sidecar.core.signal_types import signal as _s


# --- OTLP push health (sidecar/export/otlp_failures.py): every export to the OTLP receiver
# and the ones that failed. Registered by the push where it runs (ADAPTER_SIGNALS["otlp"]):
# a sidecar without --otlp-endpoint exports neither. Bounded labels: signal (metrics,
# traces), reason (OtlpFailure).
class OtlpFailure(enum.StrEnum):
    """The value of the ``reason`` label of :data:`OTLP_EXPORT_FAILURES`."""

    CONNECT = "connect"  # refused, reset or unreachable: the receiver is down
    TIMEOUT = "timeout"  # no answer within the export timeout: a silent receiver
    HTTP = "http"  # an answer that is not 2xx (500, 404, a redirect: nothing was received)
    ERROR = "error"  # anything else: a batch that cannot be encoded or sent, a gRPC error


OTLP_EXPORTS = _s("otlp_exports_total", C,
                  "Batches the OTLP push tried to export to its receiver, by signal "
                  "(metrics, traces).", ("signal",))
OTLP_EXPORT_FAILURES = _s("otlp_export_failures_total", C,
                          "OTLP export batches the receiver did not take (after the SDK's "
                          "retries), by signal and reason (connect: the receiver is down; "
                          "timeout: it does not answer; http: it answered an error status "
                          "or a redirect; error: anything else). Those values are lost to "
                          "the OTLP backend; verification goes on.", ("signal", "reason"))
OTLP_SIGNALS: tuple[Signal, ...] = (OTLP_EXPORTS, OTLP_EXPORT_FAILURES)
