"""Small shared pieces for the reference-engine tests: a recording sink and a no-cache
greedy decoder (the ground truth a cache must reproduce)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Result
from kvtestbed.engines.model import ModelConfig, TinyLlama
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

from sidecar.config.settings import SidecarConfig
from sidecar.core.monitor import Monitor
from sidecar.core.protocol import Lookup, StoredBlock

# Small enough to run in well under a second, large enough that the pool is reused (faults
# need reuse to bite) and faults (start_after=20) act on a few dozen requests.
SMALL_WORKLOAD = WorkloadConfig(conversations=20, max_turns=5)
SMALL_POOL = 64


@dataclass
class RecordingSink:
    """An EventSink that keeps every event, in order."""

    events: list[tuple[str, object]] = field(default_factory=list)

    def on_lookup(self, lookup: Lookup) -> None:
        self.events.append(("lookup", lookup))

    def on_store(self, block: StoredBlock) -> None:
        self.events.append(("store", block))

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        self.events.append(("free", (group_id, tuple(block_ids))))

    def on_request_done(self, latency_seconds: float) -> None:
        self.events.append(("done", latency_seconds))

    def of(self, kind: str) -> list:
        return [e for k, e in self.events if k == kind]


def greedy_without_cache(model: TinyLlama, tokens: Sequence[int], adapter: str,
                         max_new_tokens: int) -> tuple[int, ...]:
    """Greedy decoding that recomputes the whole sequence every step: no KV reuse at all."""
    seq = list(tokens)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = model.forward(seq, adapter).next_token
        out.append(token)
        seq.append(token)
    return tuple(out)


def run_small(fault: str = "none", seed: int = 0, **config: object) -> tuple[ReferenceEngine,
                                                                             list[Result]]:
    """The small workload on a small pool, with ``fault`` (config overrides allowed)."""
    cfg = EngineConfig(**{"num_blocks": SMALL_POOL, "fault": fault, "fault_seed": seed,
                          **config})  # type: ignore[arg-type]
    engine = ReferenceEngine(cfg)
    return engine, drive(engine, ChatWorkload(SMALL_WORKLOAD))


def outputs_by_tag(results: Sequence[Result]) -> dict[str, tuple[int, ...]]:
    return {r.request.tag: r.output_tokens for r in results}


@cache
def clean_small() -> tuple[ReferenceEngine, tuple[Result, ...]]:
    """The clean small run, shared by every test that compares against it (read-only)."""
    engine, results = run_small()
    return engine, tuple(results)


def downcasting_run(profile: str | None) -> tuple[int, float]:
    """A (re)started sidecar beside an engine that downcasts KV to fp8 from its first
    request (bfloat16), calibrating from ``profile`` (None: in memory, from this engine):
    (anomalous verdicts, tolerance at the end). The calibration-profile tests' restart."""
    engine = ReferenceEngine(EngineConfig(
        model=ModelConfig(dtype="bfloat16"), num_blocks=64, fault="storage-downcast",
        fault_start_after=0, fault_probability=0.3, kv_digest=True))
    cfg = SidecarConfig(sample_every=1, dispatch="inline", calibration_samples=16,
                        calibration_profile=profile, allocator_every_s=0.0)
    monitor = Monitor(ReferenceAdapter(engine), cfg)
    engine.sink = monitor
    monitor.start()
    try:
        drive(engine, ChatWorkload(WorkloadConfig(conversations=24,
                                                  block_size=engine.block_size)),
              max_requests=60)
    finally:
        monitor.stop()
    return sum(monitor.summary()["anomalies"].values()), monitor.verifier.tolerance
