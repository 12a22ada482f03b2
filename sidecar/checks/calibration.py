"""Calibrated recompute tolerance: learn the noise floor, tighten the tolerance, watch drift.

One fixed tolerance per dtype has to cover the noisiest reference there is: an independent
implementation (HF prefilling what vLLM cached: ~3e-2 in bf16) and the engine recomputing
with its own kernels (exactly 0) get the same 0.25, and a silent fp8 round trip of bf16 KV
(~0.2) passes both. So the tolerance is learned per deployment, per reference kind
(``"independent"`` or ``"engine"``, declared by the adapter as ``reference_kind``), dtype
and write path (``prefill``/``decode`` where the engine's probe says which wrote a block,
:class:`sidecar.core.protocol.WritePath`; ``all`` otherwise):

* **calibrating**: the first ``samples`` blocks that passed every check, compared under the
  hard tolerance (:func:`sidecar.checks.tolerance.tolerance_for`, or the deployment's override as
  the ceiling), give the noise floor: the largest error among them;
* **calibrated**: ``tolerance = clamp(multiple x floor, min_tolerance(dtype), ceiling)``.
  The ceiling caps it, so calibrating on a broken engine can never make the check looser
  than the fixed table; the minimum (a few ulps) keeps an exact-0 floor from flagging a
  lone re-rounding;
* **exact**: where the engine is exact (:data:`EXACT_PATHS`: the engine recomputing with its
  own kernels a block a prefill wrote) and the floor over the whole calibration window is
  exactly 0, the tolerance is 0: a bit-exact compare, so a change of one element by 1e-3 of
  the block's spread, far under the few-ulps minimum, is caught. Where the floor is not 0
  (a backend whose kernels are not batch-invariant, GPUs), the usual clamp applies. A
  profile entry for an exact path decides it from the start: floor 0 (over its thousands of
  blocks) measured on these kernels (:func:`~sidecar.checks.calibration_profile.host_kernels`,
  or an entry that does not say), tolerance 0 before any block is learnt; floor 0 measured on
  other kernels, exact only as learnt here, refutable; floor above 0 (float16 prefills on the
  reference engine differ in ~2% of blocks), never exact, whatever 64 blocks showed; floor
  above 0 measured on these kernels, **near-exact**: ``multiple`` x that floor, under the
  minimum where it is lower (bf16 prefills with AMX;
  :func:`~sidecar.checks.calibration_profile.near_exact_tolerance`);
* **drift**: afterwards, the ``quantile`` of the last ``window`` errors divided by the
  floor, the lower of the learnt and the profile's (a corruption present since the start
  raises the learnt floor, never the profile's; the floor never taken below ``minimum /
  multiple``, so drift reaches ``multiple`` exactly when the quantile reaches the
  tolerance). A distribution moving away from its floor shows here while every single block
  still passes.

An explicit override for a (reference, dtype) is used as-is: the operator chose it.

Calibration is **on by default** (64 clean blocks): the ceiling means it can only tighten the
fixed table, so turning it on cannot lose a detection. Learnt state lives in memory; what
survives a restart is a **profile** (:mod:`sidecar.checks.calibration_profile`, written by
``kv-sidecar calibrate`` on a trusted engine, loaded from ``SidecarConfig.calibration_profile``).
With a profile entry for the (model, dtype, KV storage, reference kind) the tolerance starts
at the profile's (clamped to ``[minimum, ceiling]``) and learning is **downward-safe**: a floor
learnt later may tighten it, never loosen it past the profile (only an operator does that, by
writing a new profile or an override). Without one the sidecar warns that it learns from
whatever engine it sits beside.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sidecar import signals as S
from sidecar.checks.calibration_profile import (
    EXACT_PATHS,
    Profile,
    ProfileEntry,
    host_kernels,
    load_profile,
    near_exact_tolerance,
)
from sidecar.checks.tolerance import (
    DEFAULT_CALIBRATION_SAMPLES,
    min_tolerance,
    override_for,
    override_problems,
    tolerance_for,
)
from sidecar.core.protocol import WritePath

log = logging.getLogger(__name__)

MIN_DRIFT_ERRORS = 16  # errors a drift quantile needs before it is reported
DEFAULT_SAMPLES = DEFAULT_CALIBRATION_SAMPLES  # SidecarConfig.calibration_samples's default


@dataclass(frozen=True)
class CalibrationConfig:
    """How tolerances are chosen (``SidecarConfig`` carries these as plain fields)."""

    samples: int = DEFAULT_SAMPLES  # clean blocks per reference and dtype; 0: no calibration
    multiple: float = 4.0  # calibrated tolerance = multiple x noise floor
    window: int = 256  # recent errors the drift quantile looks at
    quantile: float = 0.9
    overrides: dict[str, float] = field(default_factory=dict)  # "[REFERENCE:]DTYPE" -> value
    profile: Profile | None = None  # floors measured on a trusted engine (calibration_profile)

    def validate(self) -> None:
        if self.samples < 0:
            raise ValueError(f"calibration_samples must be >= 0, got {self.samples}")
        if not (self.multiple >= 1.0 and math.isfinite(self.multiple)):
            raise ValueError(f"calibration_multiple must be a finite number >= 1, "
                             f"got {self.multiple}")
        if self.window < MIN_DRIFT_ERRORS:
            raise ValueError(f"drift window must be >= {MIN_DRIFT_ERRORS}, got {self.window}")
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError(f"drift quantile must be in (0, 1], got {self.quantile}")
        problems = override_problems(self.overrides)
        if problems:
            raise ValueError("; ".join(problems))


def calibration_config(sidecar: Any) -> CalibrationConfig:
    """The calibration part of a ``SidecarConfig`` (``tolerances``, ``calibration_samples``,
    ``calibration_multiple``, ``calibration_profile``: the file is read and checked here,
    so a bad profile stops the sidecar at start with the file and field named)."""
    path = getattr(sidecar, "calibration_profile", None)
    profile = load_profile(path) if path else None
    if profile is not None:  # which of its measurements apply here depends on this
        log.info("kv-sidecar: calibration profile %s, %d entries; this process's kernels: "
                 "%s", path, len(profile.entries), host_kernels())
    return CalibrationConfig(samples=sidecar.calibration_samples,
                             multiple=sidecar.calibration_multiple,
                             overrides=dict(sidecar.tolerances), profile=profile)


@dataclass(frozen=True)
class FloorState:
    """What one (reference, dtype) calibration knows, for gauges, summaries and tests."""

    reference: str
    dtype: str
    tolerance: float
    ceiling: float
    mode: str  # "calibrating", "profile", "calibrated", "fixed" (override/calibration off)
    seen: int  # clean blocks observed while calibrating
    floor: float | None
    drift: float | None
    profile_tolerance: float | None = None  # the loaded profile's, clamped; None: no profile
    clean_blocks: int = 0  # every block that passed, since start (what a profile is made of)
    clean_max: float = 0.0  # the largest error among them
    write_path: str = WritePath.ALL.value


class NoiseFloor:
    """The calibration of one reference kind and dtype (see the module docstring)."""

    def __init__(self, reference: str, dtype: str, ceiling: float, minimum: float,
                 cfg: CalibrationConfig, fixed: bool, profile: ProfileEntry | None = None,
                 write_path: str = WritePath.ALL.value) -> None:
        self.reference, self.dtype, self.write_path = reference, dtype, write_path
        self.exact = (reference, write_path) in EXACT_PATHS
        self.ceiling, self.minimum, self.cfg = ceiling, min(minimum, ceiling), cfg
        self.fixed = fixed
        self.tolerance = ceiling
        self.floor: float | None = None
        # A profile sets the starting tolerance (and the drift's floor) and is the most the
        # learning may return to; never above the ceiling, never under the minimum.
        self.profile_tolerance: float | None = None
        self._profile_floor: float | None = None
        self._exact_trusted = False
        if profile is not None and not fixed:
            # An exact path whose trusted run never saw a bit differ (floor 0 over its
            # thousands of blocks) is compared bit-exactly from the first block: a block
            # corrupted before it is stored, from the start, is never learnt as noise.
            # Only on the kernels it was measured on (ProfileEntry.exact_here): elsewhere
            # exactness is learnt from the window, and refutable.
            self._exact_trusted = self.exact and profile.exact_here
            self.profile_tolerance = 0.0 if self._exact_trusted \
                else min(self.ceiling, near_exact_tolerance(profile)) \
                if self.exact and profile.measured_here and profile.floor > 0.0 \
                else min(self.ceiling, max(self.minimum, profile.tolerance))
            self._profile_floor = profile.floor
            self.tolerance = self.profile_tolerance
        self.learning = not fixed and cfg.samples > 0
        # Exact learnt from this window alone (no profile): a hypothesis, refuted by the
        # first block that differs by less than the minimum (see refute_exact).
        self.provisional = False
        self.clean_blocks, self.clean_max = 0, 0.0
        self._seen: list[float] = []
        self._recent: deque[float] = deque(maxlen=cfg.window)

    @property
    def calibrated(self) -> bool:
        return self.floor is not None

    def observe(self, error: float, passed: bool) -> None:
        """One recompute error; ``passed``: the block was clean under the tolerance then."""
        if not math.isfinite(error):
            error = self.ceiling * 10  # a non-finite compare is far out, not skipped
        if passed:
            self.clean_blocks += 1
            self.clean_max = max(self.clean_max, error)
        if self.fixed:
            return
        if self.floor is None:
            if not self.learning:
                self._recent.append(error)  # a profile without learning still shows drift
            elif passed:
                self._seen.append(error)
                if len(self._seen) >= self.cfg.samples:
                    self._settle()
            return
        self._recent.append(error)

    def _settle(self) -> None:
        self.floor = max(self._seen)
        # Exact only if the profile (its trusted run, far longer than this window) agrees:
        # a path that differed there (float16 prefills, 2% of blocks) is not exact here.
        exact = self.exact and self.floor == 0.0 and not self._profile_floor
        learnt = 0.0 if exact \
            else min(self.ceiling, max(self.minimum, self.cfg.multiple * self.floor))
        self.provisional = exact and not self._exact_trusted
        # Downward-safe: a floor learnt now (perhaps beside a broken engine) may tighten
        # the profile's tolerance, never loosen it.
        self.tolerance = learnt if self.profile_tolerance is None \
            else min(learnt, self.profile_tolerance)
        self._seen = []

    def refute_exact(self, error: float) -> bool:
        """A clean-looking error (over 0, within the minimum) on a path learnt exact from
        this window alone: the engine is not exact there (float16/float32 prefills on the
        reference engine differ in 2-25% of blocks, after 64 that matched). The path goes
        back to the clamp (the minimum) and the block passes; ``True`` when that happened.

        The refuting error is not learnt as the floor: it may itself be the first block of a
        corruption that began after the window (measured: a bf16 corruption starting at
        block 65 differs by 0.059, under the minimum 0.0625; learnt x4 it would have hidden
        all but 2 of the next 96 corrupted blocks)."""
        if not (self.provisional and self.tolerance == 0.0 and 0.0 < error <= self.minimum):
            return False
        self.provisional = False
        self.tolerance = self.minimum
        log.warning("kv-sidecar: %s reference, %s, %s write path: a block differed by %.3g "
                    "after %d that matched bit for bit; no longer compared exactly "
                    "(tolerance %.3g). A calibration profile decides this from a trusted run.",
                    self.reference, self.dtype, self.write_path, error, self.cfg.samples,
                    self.tolerance)
        return True

    def drift(self) -> float | None:
        """Recent error quantile / the lower of the profile's and the learnt floor (a
        profile's, measured on a trusted engine, is not raised by a corruption present
        since this start, which a learnt one is); ``None`` before either."""
        floors = [f for f in (self.floor, self._profile_floor) if f is not None]
        floor = min(floors) if floors else None
        if floor is None or len(self._recent) < MIN_DRIFT_ERRORS:
            return None
        ordered = sorted(self._recent)
        q = ordered[min(len(ordered) - 1, int(self.cfg.quantile * len(ordered)))]
        return q / max(floor, self.minimum / self.cfg.multiple)

    def state(self) -> FloorState:
        mode = "fixed" if self.fixed or (not self.learning and self.profile_tolerance is None) \
            else "calibrated" if self.calibrated \
            else "calibrating" if self.learning and self.profile_tolerance is None \
            else "profile"
        return FloorState(self.reference, self.dtype, self.tolerance, self.ceiling, mode,
                          len(self._seen), self.floor, self.drift(), self.profile_tolerance,
                          self.clean_blocks, self.clean_max, self.write_path)


class Calibration:
    """Every (reference kind, dtype) calibration of one sidecar; thread-safe (the worker
    observes, a scrape or ``/status`` reads)."""

    def __init__(self, dtype: str, kv_storage: str | None,
                 cfg: CalibrationConfig | None = None, model: str = "") -> None:
        self.cfg = cfg or CalibrationConfig()
        self.cfg.validate()
        self.dtype = dtype.removeprefix("torch.")
        self.kv_storage = kv_storage
        self.model = model  # EngineInfo.model: what a profile entry is looked up by
        self._floors: dict[tuple[str, str], NoiseFloor] = {}
        self._lock = threading.Lock()

    def _floor(self, reference: str, write_path: str = WritePath.ALL.value) -> NoiseFloor:
        nf = self._floors.get((reference, write_path))
        if nf is None:
            override = override_for(self.cfg.overrides, reference, self.dtype)
            ceiling = override if override is not None \
                else tolerance_for(self.dtype, self.kv_storage)
            entry = None if self.cfg.profile is None else self.cfg.profile.find(
                self.model, self.dtype, self.kv_storage, reference, write_path)
            nf = NoiseFloor(reference, self.dtype, ceiling, min_tolerance(self.dtype),
                            self.cfg, fixed=override is not None, profile=entry,
                            write_path=write_path)
            self._floors[(reference, write_path)] = nf
            if nf.learning and entry is None:
                where = "" if self.cfg.profile is None \
                    else f" ({self.cfg.profile.source} has no entry for it)"
                log.warning(
                    "kv-sidecar: no calibration profile for model %r, %s, %s reference, "
                    "%s write path%s: "
                    "the recompute tolerance is learnt from the first %d clean blocks of "
                    "this engine, whatever state it is in. Run `kv-sidecar calibrate` on a "
                    "trusted engine and set calibration_profile.", self.model, self.dtype,
                    reference, write_path, where, self.cfg.samples)
        return nf

    def tolerance(self, reference: str, write_path: str = WritePath.ALL.value) -> float:
        """The tolerance a comparison against ``reference`` of a block ``write_path``
        wrote uses now. A path still learning (no profile entry, too few of its own blocks
        yet: decode-written ones are ~15% of a chat's hits) uses the ``all`` floor's, which
        learns from every block, rather than the ceiling."""
        with self._lock:
            nf = self._floor(reference, write_path)
            if write_path == WritePath.ALL.value or not nf.learning or nf.calibrated \
                    or nf.profile_tolerance is not None:
                return nf.tolerance
            return min(nf.tolerance, self._floor(reference).tolerance)

    def refute_exact(self, reference: str, write_path: str, error: float) -> bool:
        """:meth:`NoiseFloor.refute_exact` of the (reference, write path) floor."""
        with self._lock:
            return self._floor(reference, write_path).refute_exact(error)

    def observe(self, reference: str, error: float, passed: bool,
                write_path: str = WritePath.ALL.value) -> None:
        """One block's error, into its path's floor and the ``all`` floor (every block)."""
        with self._lock:
            self._floor(reference, write_path).observe(error, passed)
            if write_path != WritePath.ALL.value:
                self._floor(reference).observe(error, passed)

    def states(self) -> list[FloorState]:
        with self._lock:
            return [nf.state() for nf in self._floors.values()]

    def publish(self, metrics: Any, reference: str | None = None) -> None:
        """Set the tolerance, floor and drift gauges (floor and drift only once known:
        an unknown is no series, never a 0); ``reference``: make sure its series exist."""
        if reference is not None:
            with self._lock:
                self._floor(reference)
        for st in self.states():
            labels = {"reference": st.reference, "dtype": st.dtype,
                      "write_path": st.write_path}
            metrics.gauge(S.RECOMPUTE_TOLERANCE, **labels).set(st.tolerance)
            if st.floor is not None:
                metrics.gauge(S.RECOMPUTE_NOISE_FLOOR, **labels).set(st.floor)
            if st.drift is not None:
                metrics.gauge(S.RECOMPUTE_ERROR_DRIFT, **labels).set(st.drift)
