"""Allocator health: invariant checks on the engine's block pool, the block lifecycle log,
leak detection, and event-driven polling (seed 001 §3.2, §4.2, §4.3, §5.4, §6.3, §7.3).

The sidecar does the checking, engine-agnostically: an adapter that offers
:class:`~sidecar.core.protocol.AllocatorIntrospection` hands over plain snapshots of its block
tables and the checks here recompute who holds what; nothing asks the engine whether it
thinks it is healthy.
"""

from sidecar.allocator.hit_counter import HitCounterAudit
from sidecar.allocator.invariants import Violation, check_counts, check_snapshot, unheld_references
from sidecar.allocator.leak import LeakTrend, unheld_from_state
from sidecar.allocator.lifecycle import LifecycleEvent, LifecycleLog, LifecycleOp
from sidecar.allocator.poll_health import AllocatorHealth, allocation_failure_rate

__all__ = [
    "AllocatorHealth",
    "HitCounterAudit",
    "LeakTrend",
    "LifecycleEvent",
    "LifecycleLog",
    "LifecycleOp",
    "Violation",
    "allocation_failure_rate",
    "check_counts",
    "check_snapshot",
    "unheld_references",
    "unheld_from_state",
]
