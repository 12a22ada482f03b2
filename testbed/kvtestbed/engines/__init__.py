"""The reference paged prefix-caching engine: a tiny Llama over a paged KV pool with a
chained-hash prefix index, LRU eviction, generation stamps and fault injection. It is what
the demo, the tests and the detection benchmark run the sidecar against.

Entry points: :class:`ReferenceEngine` with :class:`EngineConfig`, the workload
(:class:`ChatWorkload`, :func:`drive`), the fault registry (:data:`FAULTS`), and the adapter
in :mod:`kvtestbed.adapters.paged_adapter`.
"""

from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request, Result
from kvtestbed.engines.faults import FAULTS, Fault, describe_faults, make_fault
from kvtestbed.engines.hybrid_faults import fault_applies  # registers hybrid faults
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

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
