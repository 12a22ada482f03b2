"""The fault registry: every injectable fault by name (``kv-sidecar faults``), and how to make
one. The faults live by job in :mod:`~kvtestbed.engines.content_faults`,
:mod:`~kvtestbed.engines.allocator_faults` and :mod:`~kvtestbed.engines.movement_faults`, on
the base in :mod:`~kvtestbed.engines.fault_base` (which says how to add one); hybrid faults
register themselves from :mod:`kvtestbed.engines.hybrid_faults`.
"""

from __future__ import annotations

from typing import Any

from kvtestbed.engines.allocator_faults import (
    BoundaryOffByOne,
    Fragmentation,
    GaugeNotARate,
    HashCollision,
    KeyMissingField,
    Leak,
    PrematureFree,
    StaleReuse,
)
from kvtestbed.engines.content_faults import (
    BitFlip,
    NonFinite,
    QuantizationDrift,
    StorageDowncast,
    ZeroBlock,
)
from kvtestbed.engines.fault_base import MAX_INJECTIONS, Fault, Injection
from kvtestbed.engines.movement_faults import (
    FailedLoadAsHit,
    LayoutMismatch,
    NamespaceMissingAtTier,
    PartialLoad,
    TornAsyncCopy,
    TornWrite,
)

__all__ = [
    "FAULTS", "MAX_INJECTIONS", "BitFlip", "BoundaryOffByOne", "FailedLoadAsHit", "Fault",
    "Fragmentation", "GaugeNotARate", "HashCollision", "Injection", "KeyMissingField",
    "LayoutMismatch", "Leak", "NamespaceMissingAtTier", "NonFinite", "PartialLoad", "PrematureFree",
    "QuantizationDrift", "StaleReuse", "StorageDowncast", "TornAsyncCopy", "TornWrite",
    "ZeroBlock", "describe_faults", "make_fault",
]


FAULTS: dict[str, type[Fault]] = {
    cls.name: cls
    for cls in (Fault, ZeroBlock, NonFinite, BoundaryOffByOne, StaleReuse, KeyMissingField,
                HashCollision, PrematureFree, Leak, BitFlip, Fragmentation, TornWrite,
                FailedLoadAsHit, LayoutMismatch, QuantizationDrift, StorageDowncast,
                PartialLoad, TornAsyncCopy, NamespaceMissingAtTier, GaugeNotARate)
}


def make_fault(name: str, seed: int = 0, start_after: int | None = None,
               probability: float | None = None, **params: Any) -> Fault:
    """Instantiate a fault by name (``kv-sidecar faults`` lists them); ``params`` are the
    fault's own knobs (e.g. ``buckets`` for hash-collision)."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    return FAULTS[name](seed=seed, start_after=start_after, probability=probability, **params)


def describe_faults() -> list[tuple[str, str]]:
    """(name, one-line description) of every fault, in registry order."""
    return [(name, cls.description) for name, cls in FAULTS.items()]
