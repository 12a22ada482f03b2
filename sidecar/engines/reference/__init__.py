"""The reference paged prefix-caching engine: a tiny Llama over a paged KV pool with a
chained-hash prefix index, LRU eviction, generation stamps and fault injection. It is what
the demo, the tests and the detection benchmark run the sidecar against.

Entry points: :class:`ReferenceEngine` with :class:`EngineConfig`, the workload
(:class:`ChatWorkload`, :func:`drive`), the fault registry (:data:`FAULTS`), and the adapter
in :mod:`sidecar.adapters.reference`.
"""

from sidecar.engines.reference.engine import EngineConfig, ReferenceEngine, Request, Result
from sidecar.engines.reference.faults import FAULTS, Fault, describe_faults, make_fault
from sidecar.engines.reference.hybrid_faults import fault_applies  # registers hybrid faults
from sidecar.engines.reference.model import ModelConfig
from sidecar.engines.reference.workload import ChatWorkload, WorkloadConfig, drive

__all__ = [
    "FAULTS",
    "ChatWorkload",
    "EngineConfig",
    "Fault",
    "ModelConfig",
    "ReferenceEngine",
    "Request",
    "Result",
    "WorkloadConfig",
    "describe_faults",
    "drive",
    "fault_applies",
    "make_fault",
]
