"""One benchmark scenario: the reference engine with a fault, the sidecar attached, scored
against the engine's ground truth.

The sidecar is the real one (Monitor, Verifier, checks, allocator health); only its timing
is changed: a sampled hit is verified *synchronously at lookup time* instead of on the
worker thread, and the allocator is polled after every finished request, so a run is
deterministic under its seed and "samples until first detection" means the same thing
every time. The ground truth (:mod:`kvtestbed.engines.truth`) knows, for every
hit, which of its blocks hold KV the hit's own tokens and key fields would not produce.
Nothing here knows how a particular fault works, so a fault added to the registry is
benchmarked without changing this code.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from kvtestbed.adapters.hybrid_adapter import make_adapter
from kvtestbed.engines.engine import EngineConfig
from kvtestbed.engines.faults import FAULTS
from kvtestbed.engines.hybrid_engine import build_engine
from kvtestbed.engines.hybrid_model import model_config
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from sidecar import signals as S
from sidecar.allocator import allocation_failure_rate
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import CacheGroup, Hit, Lookup, SequenceId, StoredBlock
from sidecar.core.sampling import (
    AdaptiveSampler,
    BoundaryBiasedSampler,
    Sampler,
    UniformSampler,
)
from sidecar.export.metrics import fragmentation_ratio
from sidecar.signals import THRESHOLDS

ALL_BLOCKS = 1 << 20  # blocks_per_sample that makes every block of a sampled hit verified
POLICIES = ("uniform", "uniform-random-blocks", "boundary-biased", "adaptive")


@dataclass(frozen=True)
class Scenario:
    """What one run is: fault, dtype, workload size, sampling policy and budget."""

    fault: str = "none"
    dtype: str = "float32"
    kv_storage: str | None = None  # None: the model dtype, or what the fault needs
    requests: int = 300
    sample_every: int = 2
    blocks_per_sample: int | None = None  # None: every block of a sampled hit
    policy: str = "uniform"
    seed: int = 0
    fault_probability: float | None = None  # None: the fault's default
    num_blocks: int = 128
    kv_digest: bool = True
    # Keep serving (in chunks of 50 requests) until this many blocks were verified.
    min_verified_blocks: int = 0
    # Clean blocks the sidecar calibrates its tolerance from (0: the fixed table); the
    # bench's 64 are verified before a fault's start_after (20 requests) in every dtype.
    calibration_samples: int = 0
    calibration_multiple: float = 4.0
    calibration_profile: str | None = None  # a profile file the runs start from (None: none)
    model: str = "reference"  # reference | hybrid | recurrent (demo --model)

    def label(self) -> str:
        storage = f"+{self.kv_storage}" if self.kv_storage else ""
        model = "" if self.model == "reference" else f"{self.model}/"
        return f"{model}{self.fault}/{self.dtype}{storage}/{self.policy}/seed{self.seed}"


@dataclass
class ScenarioResult:
    """What one run measured (see :class:`BenchSink` for each counter's definition)."""

    scenario: Scenario
    kv_storage: str | None
    requests: int = 0
    hits: int = 0
    affected: int = 0
    sampled: int = 0
    bad_verified: int = 0
    detected: int = 0
    detected_any: int = 0  # affected sampled hits flagged on any wrong block (what one sees)
    false_alarm_blocks: int = 0
    false_alarm_hits: int = 0
    verified_hits: int = 0
    verified_blocks: int = 0
    dropped_blocks: int = 0
    tainted_only: int = 0  # hits with no corrupt block but KV computed over a wrong past
    samples_to_first_detection: int | None = None
    blocks_to_first_detection: int | None = None
    kinds: Counter[str] = field(default_factory=Counter)
    false_alarm_kinds: Counter[str] = field(default_factory=Counter)  # "kind@groupN"
    max_clean_error: float = 0.0
    injections: int = 0
    first_injection_request: int | None = None
    # allocator signal -> index of the last request submitted when it first fired
    allocator_alarms: dict[str, int] = field(default_factory=dict)
    tolerance: float = 0.0  # in use at the end of the run (calibrated, where it was)
    calibrated_floor: float | None = None
    wall_s: float = 0.0

    @property
    def recall(self) -> float | None:
        """detected / affected hits sampled with a corrupt block among the verified ones."""
        return self.detected / self.bad_verified if self.bad_verified else None

    @property
    def requests_to_allocator_detection(self) -> int | None:
        if not self.allocator_alarms or self.first_injection_request is None:
            return None
        return max(0, min(self.allocator_alarms.values()) - self.first_injection_request)


def make_sampler(policy: str, every: int, block_size: int, seed: int) -> Sampler:
    if policy == "uniform":
        return UniformSampler(every, seed)
    if policy == "uniform-random-blocks":
        return UniformSampler(every, seed, last_block=False)
    if policy == "boundary-biased":
        return BoundaryBiasedSampler(every, block_size, seed)
    if policy == "adaptive":
        return AdaptiveSampler(every, seed)
    raise ValueError(f"unknown sampling policy {policy!r}; known: {', '.join(POLICIES)}")


class _Deferred:
    """The monitor's sampler: it lets the monitor count every hit as usual but never
    queues one; the bench asks the real policy and verifies in the engine's thread."""

    def __init__(self, policy: Sampler) -> None:
        self.policy = policy
        self.decision = False

    def should_sample(self, hit: Hit) -> bool:
        self.decision = self.policy.should_sample(hit)
        return False

    def choose(self, hit: Hit, block_size: int, max_blocks: int,
               groups: Sequence[CacheGroup] = ()) -> list[Any]:
        return list(self.policy.choose(hit, block_size, max_blocks, groups))

    def feedback(self, hit: Hit, anomalous: bool) -> None:
        self.policy.feedback(hit, anomalous)


class BenchSink:
    """The engine's event sink: forwards every event to the Monitor, verifies sampled hits
    synchronously and scores each verdict against the ground truth.

    * ``affected``: hits with at least one corrupt block (truth), sampled or not;
    * ``sampled``: affected hits the policy chose; ``bad_verified``: of those, the ones
      where a corrupt block was among the blocks verified (all of them by default);
    * ``detected``: of ``bad_verified``, the hits where a verified corrupt block itself
      was flagged; ``detected_any``: sampled affected hits with an anomaly on any wrong
      block, corrupt or tainted (a hit can be caught through a tainted block when its
      corrupt one went unchecked): what an operator sees, and what "first detection" counts;
    * ``false_alarm_blocks``: anomalies on blocks the truth calls good, on any hit.

    Tainted blocks (right bytes, computed over a wrong past) are neither: flagging one is no
    false alarm, missing one is no miss (:mod:`kvtestbed.engines.truth`).
    """

    def __init__(self, engine: Any, monitor: Monitor, deferred: _Deferred,
                 result: ScenarioResult) -> None:
        self.engine = engine
        self.monitor = monitor
        self.deferred = deferred
        self.r = result
        self._since_first_affected: tuple[int, int] | None = None  # (hits, blocks) verified

    # Optional lifecycle events: forwarded where the monitor has them.
    def on_allocate(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int],
                    generations: Sequence[int]) -> None:
        hook = getattr(self.monitor, "on_allocate", None)
        if hook is not None:
            hook(group_id, seq_id, block_ids, generations)

    def on_release(self, group_id: int, seq_id: SequenceId, block_ids: Sequence[int]) -> None:
        hook = getattr(self.monitor, "on_release", None)
        if hook is not None:
            hook(group_id, seq_id, block_ids)
        self._observe("observe_release", group_id, seq_id, block_ids)

    def on_store(self, block: StoredBlock) -> None:
        self.monitor.on_store(block)
        self._observe("observe_store", block)

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        self.monitor.on_free(group_id, block_ids)
        self._observe("observe_free", group_id, block_ids)

    def _observe(self, name: str, *args: Any) -> None:
        """Cache events for a policy that learns from them (boundary-biased). The Monitor
        forwards them to its own sampler; here the policy sits behind the bench's deferring
        wrapper, so the bench forwards them itself."""
        hook = getattr(self.deferred.policy, name, None)
        if hook is not None:
            hook(*args)

    def on_request_done(self, latency_seconds: float) -> None:
        self.monitor.on_request_done(latency_seconds)
        self.r.requests += 1
        self._poll_allocator()

    def on_lookup(self, lookup: Lookup) -> None:
        self.deferred.decision = False  # the monitor asks the policy only about hits
        self.monitor.on_lookup(lookup)
        hit = lookup.hit
        if hit is None or lookup.hit_tokens <= 0:
            return
        r = self.r
        r.hits += 1
        truth = self.engine.truth
        corrupt_list, tainted_list = truth.classify(hit) if truth is not None else ([], [])
        corrupt, tainted = _pairs(corrupt_list), _pairs(tainted_list)
        bad = corrupt | tainted
        if corrupt:
            r.affected += 1
            if self._since_first_affected is None:
                self._since_first_affected = (0, 0)
        elif tainted:
            r.tainted_only += 1
        if not self.deferred.decision:
            return
        self.monitor.metrics.inc(S.SAMPLED)
        verdict = self.monitor.verify(hit)
        verified = {(ref.group_id, ref.index) for ref in verdict.verified}
        r.verified_hits += 1 if verified else 0
        r.verified_blocks += len(verified)
        r.dropped_blocks += sum(verdict.dropped.values())
        if self._since_first_affected is not None:
            h, b = self._since_first_affected
            self._since_first_affected = (h + 1, b + len(verified))
        flagged = {(f.group_id, f.block_index) for f in verdict.findings}
        wrong = flagged - bad
        r.false_alarm_kinds.update(f"{f.kind.value}@group{f.group_id}" for f in verdict.findings
                                   if (f.group_id, f.block_index) in wrong)
        r.false_alarm_blocks += len(wrong)
        r.false_alarm_hits += 1 if wrong else 0
        if not bad and verdict.max_error is not None:
            r.max_clean_error = max(r.max_clean_error, verdict.max_error)
        if not corrupt:
            return
        r.sampled += 1
        caught = bool(flagged & bad)
        if caught:
            r.detected_any += 1
            r.kinds.update({f.kind.value for f in verdict.findings
                            if (f.group_id, f.block_index) in bad})
            if r.samples_to_first_detection is None and self._since_first_affected:
                r.samples_to_first_detection, r.blocks_to_first_detection = \
                    self._since_first_affected
        # A block a check flagged was decided even where no read or recompute was spent on
        # it (a null block at a position its group must cover is found by coverage).
        if corrupt & (verified | flagged):
            r.bad_verified += 1
            r.detected += 1 if flagged & corrupt else 0  # the corrupt block itself flagged

    def _poll_allocator(self) -> None:
        """Allocator signals, read as an alert rule would (thresholds from signals.py)."""
        state = self.monitor.poll_allocator()
        m = self.monitor.metrics
        now = self.engine.stats["submitted"] - 1  # request index, as the fault records it
        alarms = self.r.allocator_alarms
        fired: list[str] = []
        if m.value_sum(S.INVARIANT_VIOLATIONS.name) > 0:
            fired.append("invariant_violation")
            if not FAULTS[self.r.scenario.fault].corrupts_kv:  # the kinds name what caught it
                for kind, n in m.by_label(S.INVARIANT_VIOLATIONS.name, "kind").items():
                    if n > 0:
                        self.r.kinds[kind] = int(n)
        if m.value(S.LEAK_SUSPECTED_FLAG.name) > 0:
            fired.append("leak_suspected")
        if state is not None:
            if allocation_failure_rate(state) > THRESHOLDS.allocation_failure_rate:
                fired.append("allocation_failures")
            if (fragmentation_ratio(state) or 0.0) > THRESHOLDS.fragmentation_ratio:
                fired.append("fragmentation")
        for name in fired:
            alarms.setdefault(name, now)


def _pairs(indices: Sequence[Any]) -> set[tuple[int, int]]:
    """Ground-truth blocks as (group, index): the plain engine's truth names indices of
    group 0, the hybrid one's names (group, index) pairs already."""
    return {(0, int(i)) if isinstance(i, int) else (int(i[0]), int(i[1])) for i in indices}


def run_scenario(sc: Scenario) -> ScenarioResult:
    """Run one scenario to completion and score it."""
    if sc.fault not in FAULTS:
        raise ValueError(f"unknown fault {sc.fault!r}; known: {', '.join(FAULTS)}")
    started = time.perf_counter()
    engine = build_engine(EngineConfig(
        model=model_config(sc.model, sc.dtype, sc.seed), num_blocks=sc.num_blocks,
        fault=sc.fault, fault_seed=sc.seed, fault_probability=sc.fault_probability,
        kv_storage=sc.kv_storage, kv_digest=sc.kv_digest and sc.model == "reference",
        track_truth=True, model_kind=sc.model))
    adapter: Any = make_adapter(engine)
    deferred = _Deferred(make_sampler(sc.policy, sc.sample_every, engine.block_size, sc.seed))
    monitor = Monitor(adapter, SidecarConfig(
        sample_every=sc.sample_every, blocks_per_sample=sc.blocks_per_sample or ALL_BLOCKS,
        recompute_tokens_per_s=0, seed=sc.seed, allocator_check_min_interval_s=-1,
        calibration_samples=sc.calibration_samples,
        calibration_multiple=sc.calibration_multiple,
        calibration_profile=sc.calibration_profile), sampler=deferred)
    result = ScenarioResult(sc, engine.config.kv_storage)
    engine.sink = BenchSink(engine, monitor, deferred, result)
    # Conversations open lazily (a few at a time), so a generous count changes nothing
    # but lets a run extend until it verified enough blocks.
    workload = ChatWorkload(WorkloadConfig(seed=sc.seed, conversations=sc.requests + 10_000,
                                           block_size=engine.block_size))
    drive(engine, workload, max_requests=sc.requests)
    limit = sc.requests + 100 * max(sc.min_verified_blocks, 1)
    while result.verified_blocks < sc.min_verified_blocks and workload.requests_issued < limit:
        drive(engine, workload, max_requests=workload.requests_issued + 50)
    injections = engine.fault.injections
    result.injections = len(injections)
    result.first_injection_request = min((i.request_index for i in injections), default=None)
    result.tolerance = monitor.verifier.tolerance
    states = [s for s in monitor.verifier.calibration.states() if s.write_path == "all"]
    result.calibrated_floor = states[0].floor if states else None  # over every block
    result.wall_s = time.perf_counter() - started
    return result


def _init_worker(quiet: bool) -> None:
    if quiet:
        logging.getLogger("sidecar").setLevel(logging.ERROR)


def run_many(scenarios: Sequence[Scenario], jobs: int = 1, quiet: bool = True,
             progress: Callable[[int, int, ScenarioResult], None] | None = None,
             ) -> list[ScenarioResult]:
    """Run scenarios (in ``jobs`` worker processes when > 1); results in input order."""
    _init_worker(quiet)
    results: list[ScenarioResult | None] = [None] * len(scenarios)
    done = 0
    if jobs <= 1 or len(scenarios) <= 1:
        for i, sc in enumerate(scenarios):
            results[i] = run_scenario(sc)
            done += 1
            if progress is not None:
                progress(done, len(scenarios), results[i])  # type: ignore[arg-type]
    else:
        # spawn: a forked torch process with live threads can deadlock.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker,
                                 initargs=(quiet,)) as pool:
            futures = {pool.submit(run_scenario, sc): i for i, sc in enumerate(scenarios)}
            for fut in as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                done += 1
                if progress is not None:
                    progress(done, len(scenarios), results[i])  # type: ignore[arg-type]
    return [r for r in results if r is not None]
