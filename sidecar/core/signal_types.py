"""What a signal is: its name, kind, help and labels (:class:`Signal`), shared by the core's
signals (:mod:`sidecar.signals`) and each adapter's own set beside it. Here, not in the
``sidecar.signals`` package, so that an adapter's set can be imported on its own: the
package imports every set to assemble ``ALL_SIGNALS``, and a set that imported the package
back would find it half-built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

NAMESPACE = "kvsidecar"

# Labels every series carries; all of them have bounded values (one per engine/model).
BASE_LABELS: tuple[str, ...] = ("engine", "model")


class MetricType(enum.StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"
    INFO = "info"


@dataclass(frozen=True)
class Signal:
    """One exported series family. ``name`` is the exposition name (``_total`` included
    for counters); ``labels`` are the labels beyond :data:`BASE_LABELS`."""

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def base_name(self) -> str:
        """The name prometheus-client wants (it appends ``_total`` to counters itself)."""
        if self.type is MetricType.COUNTER and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
VERIFY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
CHECK_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def signal(name: str, type_: MetricType, help_: str, labels: tuple[str, ...] = (),
       unit: str = "", buckets: tuple[float, ...] = ()) -> Signal:
    return Signal(f"{NAMESPACE}_{name}", type_, help_, labels, unit, buckets)


C, G, H = MetricType.COUNTER, MetricType.GAUGE, MetricType.HISTOGRAM

