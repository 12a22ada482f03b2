"""Compare two greedy answers position by position, and the tolerance they are held to.

The divergence of two answers is the largest top-k logprob difference over the generated
positions. A token in one answer's top-k but missing from the other's is compared with the
other's k-th logprob, a lower bound on its difference (it ranked below all k there). Once
the greedy tokens differ, later positions continue different texts and say nothing about
the cache, so comparison stops after the first differing position: that position's own
difference (two near-tied candidates swapped by noise, or a real change) is still counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.canary.client import Completion
from sidecar.signals import CANARY_THRESHOLDS, CanaryThresholds


@dataclass(frozen=True)
class Divergence:
    value: float  # largest top-k logprob difference
    position: int  # where it was largest (-1: nothing compared)
    compared: int  # generated positions compared
    token_diverged_at: int | None  # first position whose greedy tokens differ


def _position(a: dict[str, float], b: dict[str, float]) -> float:
    if not a or not b:
        return 0.0
    worst = 0.0
    floor_a, floor_b = min(a.values()), min(b.values())
    for tok, va in a.items():
        vb = b.get(tok)
        worst = max(worst, abs(va - vb) if vb is not None else va - floor_b)
    for tok, vb in b.items():
        if tok not in a:
            worst = max(worst, vb - floor_a)
    return worst


def divergence(a: Completion, b: Completion) -> Divergence:
    n = min(len(a.top_logprobs), len(b.top_logprobs))
    best, where, diverged = 0.0, -1, None
    compared = 0
    for i in range(n):
        d = _position(a.top_logprobs[i], b.top_logprobs[i])
        compared += 1
        if d > best or where < 0:
            best, where = max(best, d), i
        ta = a.tokens[i] if i < len(a.tokens) else None
        tb = b.tokens[i] if i < len(b.tokens) else None
        if ta != tb:
            diverged = i
            break
    return Divergence(best, where, compared, diverged)


@dataclass
class Tolerance:
    """``max(hard floor, multiple x noise floor)``, capped at the dtype's ceiling.

    The noise floor is the largest divergence seen over the first ``calibration`` clean
    pairs. In salt mode a sample is miss vs miss, which no cache fault can touch
    (``trusted``): the tolerance follows it from the first sample. Otherwise a sample is hit
    vs miss, so until calibrated the ceiling is in force (a gross fault is caught from the
    first pair) and a sample above the ceiling is an anomaly, never noise."""

    dtype: str
    calibration: int = 8
    thresholds: CanaryThresholds = CANARY_THRESHOLDS
    noise: list[float] = field(default_factory=list)
    trusted: bool = False

    @property
    def floor(self) -> float:
        return self.thresholds.floor_for(self.dtype)

    @property
    def ceiling(self) -> float:
        return self.thresholds.ceiling_for(self.dtype)

    @property
    def calibrated(self) -> bool:
        return len(self.noise) >= self.calibration

    @property
    def noise_floor(self) -> float:
        return max(self.noise) if self.noise else 0.0

    @property
    def value(self) -> float:
        if not self.calibrated and not (self.trusted and self.noise):
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.thresholds.multiple * self.noise_floor))

    def learn(self, clean_divergence: float) -> None:
        """Record one noise sample (ignored once calibrated, or when above the ceiling)."""
        if not self.calibrated and clean_divergence <= self.ceiling:
            self.noise.append(clean_divergence)
