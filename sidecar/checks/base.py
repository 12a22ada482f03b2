"""The result type every check returns."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.signals import AnomalyKind


@dataclass(frozen=True)
class Finding:
    """One anomaly on one block. ``detail`` is for logs and evidence, never a label."""

    kind: AnomalyKind
    group_id: int
    block_index: int
    detail: str
    value: float | None = None
