"""The reference paged prefix-caching engine: a tiny Llama over a paged KV pool with a
chained-hash prefix index, LRU eviction, generation stamps and fault injection. It is what
the demo, the tests and the detection benchmark run the sidecar against.

Entry points: :class:`ReferenceEngine` with :class:`EngineConfig`, the fault registry
(:data:`FAULTS`), and the adapter in :mod:`kvtestbed.adapters.paged_adapter`. The workload
that drives it (:mod:`kvtestbed.workload`) imports the engine, so it is not re-exported here:
that would be an import circle (``import kvtestbed.workload`` first failed).
"""

from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request, Result
from kvtestbed.engines.faults import FAULTS, Fault, describe_faults, make_fault
from kvtestbed.engines.hybrid_faults import fault_applies  # registers hybrid faults
from kvtestbed.engines.model import ModelConfig

__all__ = [
    "FAULTS",
    "EngineConfig",
    "Fault",
    "ModelConfig",
    "ReferenceEngine",
    "Request",
    "Result",
    "describe_faults",
    "fault_applies",
    "make_fault",
]
