"""The sidecar's knobs (:class:`SidecarConfig`), with defaults fit for production.

Kept apart from :mod:`sidecar.monitor` so a configuration can be built, validated and
printed without the Monitor; ``sidecar.monitor`` re-exports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sidecar.calibration import calibration_config
from sidecar.dispatch import MODES, Mode


@dataclass
class SidecarConfig:
    """Knobs with defaults fit for production; the demo lowers ``sample_every``."""

    sample_every: int = 1000
    blocks_per_sample: int = 2
    queue_size: int = 64
    adapter_timeout_s: float = 5.0
    recompute_tokens_per_s: float = 100_000.0  # recompute budget; <= 0 means unlimited
    recompute: bool = True
    store_records: int = 200_000  # bounded memory of stored blocks (LRU)
    evidence_capacity: int = 100
    evidence_dir: str | None = None
    latency_window: int = 10_000  # recent request latencies kept for the P99 summary
    seed: int = 0
    # Allocator health (sidecar/allocator). Besides the scheduled poll, a release or a
    # finished request triggers an invariant check, at most once per this interval
    # (0: after every event; < 0: scheduled polls only).
    allocator_check_min_interval_s: float = 0.25
    lifecycle_sample_rate: float = 0.01  # block lifecycle events logged outside bursts
    lifecycle_window: int = 2048  # full-rate lifecycle events kept in memory for evidence
    lifecycle_burst: int = 256  # events logged at full rate after an anomaly
    leak_window: int = 8  # polls the leak trend test looks at
    # Capture at match time: where the adapter offers ``capture`` (served bytes copied before
    # the hook returns), at most this many bytes per sample (larger captures are skipped).
    capture: bool = True
    capture_max_bytes: int = 64 * 2**20
    # Where samples go (sidecar.dispatch): queued (a worker thread), inline, deferred.
    dispatch: Mode = "queued"
    allocator_every_s: float = 1.0  # scheduled allocator polls (<= 0: none)
    # Recompute tolerance (sidecar/calibration.py): overrides "[REFERENCE:]DTYPE" -> value;
    # learn the noise floor from this many clean blocks (0: the fixed table), then use
    # calibration_multiple x floor (capped by the hard tolerance, floored at a few ulps).
    tolerances: dict[str, float] = dataclasses.field(default_factory=dict)
    calibration_samples: int = 0
    calibration_multiple: float = 4.0
    # Admission control (sidecar/admission.py, hcore): at most this many adapter recomputes
    # in flight at once (abandoned timed-out ones included) and this many verifications of
    # tier-recovered blocks; over the cap a sample is dropped (reason "admission"). <= 0:
    # no cap.
    max_concurrent_recomputes: int = 2
    max_concurrent_recoveries: int = 4

    def validate(self) -> None:
        for name in ("sample_every", "queue_size", "store_records", "evidence_capacity",
                     "latency_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.blocks_per_sample < 1:
            raise ValueError(f"blocks_per_sample must be >= 1, got {self.blocks_per_sample}")
        if not self.adapter_timeout_s > 0:
            raise ValueError(f"adapter_timeout_s must be > 0, got {self.adapter_timeout_s}")
        if not 0.0 <= self.lifecycle_sample_rate <= 1.0:
            raise ValueError(f"lifecycle_sample_rate must be in [0, 1], got "
                             f"{self.lifecycle_sample_rate}")
        if self.leak_window < 2:
            raise ValueError(f"leak_window must be >= 2, got {self.leak_window}")
        if self.dispatch not in MODES:
            raise ValueError(f"dispatch must be one of {', '.join(MODES)}, got "
                             f"{self.dispatch!r}")
        calibration_config(self).validate()
