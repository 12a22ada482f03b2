"""Engine-level figures of ``kv-sidecar bench perf``, on the reference engine under the
seeded chat workload: throughput with the sidecar attached vs detached (wall and
engine-thread CPU), sampled-hit-to-verdict latency next to one prefill of the prefix, and
the engine thread's hook tail latency while the verifier is busy."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines import EngineConfig, ModelConfig, ReferenceEngine
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from sidecar.checks.verifier import Verdict
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import Lookup

# A realistic prefill for the "share of prefill" figure: an 8B dense model does about
# 2 x 8e9 FLOPs per prompt token; 400 TFLOP/s is a sustained bf16 prefill on one H100-class
# GPU (about 40% of its dense peak). Stated, not measured here.
PREFILL_FLOPS_PER_TOKEN_8B = 2 * 8e9
PREFILL_FLOP_PER_S = 400e12


def _engine(seed: int, num_blocks: int = 256, kv_digest: bool = True) -> ReferenceEngine:
    """``kv_digest``: the write-time fingerprint exists for the sidecar only, so the
    detached baseline computes none and the attached runs pay for it (issue 22)."""
    return ReferenceEngine(EngineConfig(model=ModelConfig(dtype="float32", seed=seed),
                                        num_blocks=num_blocks, kv_digest=kv_digest))


def _workload(engine: ReferenceEngine, seed: int, requests: int) -> ChatWorkload:
    return ChatWorkload(WorkloadConfig(seed=seed, conversations=max(8, requests // 3 + 8),
                                       block_size=engine.block_size))


START_BURST = "N=1000, first hits after a start (burst: 1 in 10)"
PROCESS_1000, PROCESS_100 = "N=1000, dispatch=process", "N=100, dispatch=process"
# Each configuration of the engine figure: its name and run_engine's arguments (the
# baseline first: the ratios divide by it).
ENGINE_CONFIGS: dict[str, dict[str, Any]] = {
    "detached": {"sample_every": None},
    "N=1000": {"sample_every": 1000},
    "N=100": {"sample_every": 100},
    START_BURST: {"sample_every": 1000, "start_burst": True},
    # the Monitor in a sidecar process of its own (sidecar.adapters.remote): its CPU reported apart
    PROCESS_1000: {"sample_every": 1000, "dispatch": "process"},
    PROCESS_100: {"sample_every": 100, "dispatch": "process"},
}
ENGINE_RUNS = tuple(ENGINE_CONFIGS)


def run_engine(requests: int, sample_every: int | None, seed: int = 0,
               time_lookups: bool = False, unlimited_budget: bool = False,
               start_burst: bool = False, dispatch: str = "queued") -> dict[str, Any]:
    """One seeded run. ``sample_every=None``: detached (no sink at all, no fingerprint).
    Steady state unless ``start_burst``: a sidecar samples its first 1,000 hits after a
    start 1 in 10 whatever N is (sidecar/core/burst.py), which would make every run of a
    few hundred requests measure 1 in 10 under the name of N (it did until this was split).

    Three clocks: wall time of the drive; the engine thread's CPU (``thread_time``); and
    the whole process's CPU (``process_time``: every thread, the journal's, the
    verifier's and the poller's included), from the drive's start until the sidecar has
    drained and stopped, so deferred work is counted, not left behind.

    ``dispatch="process"``: the Monitor runs in a sidecar process (started before the
    clocks, like the in-process Monitor); ``process_cpu_s`` is then the engine's process
    only (hooks, capture, the front's shipper, ZMQ's I/O thread) and ``sidecar_cpu_s`` the
    sidecar process's CPU over the same window, up to its drain."""
    engine = _engine(seed, kv_digest=sample_every is not None)
    if dispatch == "process" and sample_every is not None:
        return _run_process(engine, requests, sample_every, seed, time_lookups,
                            unlimited_budget)
    monitor: Monitor | None = None
    verify_latency: list[float] = []
    lookup_ns: list[int] = []
    lookup_sampled: list[bool] = []
    if sample_every is not None:
        cfg = SidecarConfig(sample_every=sample_every, seed=seed,
                            recompute_tokens_per_s=0 if unlimited_budget else 100_000.0,
                            burst_hits=SidecarConfig.burst_hits if start_burst else 0)
        monitor = Monitor(ReferenceAdapter(engine), cfg)
        if time_lookups:
            _time_lookups(monitor, lookup_ns, lookup_sampled, take="_enqueue")
        _time_verdicts(monitor, verify_latency)
        engine.sink = monitor
        monitor.start()
    prompt_tokens = 0
    workload = _workload(engine, seed, requests)
    wall0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
    results = drive(engine, workload, max_requests=requests)
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    for r in results:
        prompt_tokens += r.prompt_tokens
    hits = sampled = 0
    if monitor is not None:
        monitor.drain(timeout_s=120)
        monitor.stop()
        counts = monitor.summary()  # after the clocks' window: not a cost of the run
        hits, sampled = counts["hits"], counts["sampled"]
    process_cpu = time.process_time() - proc0
    return {"wall_s": wall, "engine_cpu_s": cpu, "process_cpu_s": process_cpu,
            "requests": len(results), "prompt_tokens": prompt_tokens, "hits": hits,
            "samples": sampled, "verify_latency_s": verify_latency, "lookup_ns": lookup_ns,
            "sampled": lookup_sampled}


def _run_process(engine: ReferenceEngine, requests: int, sample_every: int, seed: int,
                 time_lookups: bool, unlimited_budget: bool) -> dict[str, Any]:
    """:func:`run_engine` with ``dispatch="process"`` (see there)."""
    from sidecar.adapters.remote.process import SidecarProcess

    cfg = SidecarConfig(sample_every=sample_every, seed=seed, dispatch="process",
                        recompute_tokens_per_s=0 if unlimited_budget else 100_000.0,
                        burst_hits=0)
    sidecar = SidecarProcess(ReferenceAdapter(engine), cfg).start()
    front = sidecar.front
    lookup_ns: list[int] = []
    lookup_sampled: list[bool] = []
    if time_lookups:
        _time_lookups(front, lookup_ns, lookup_sampled, take="_sampled")
    engine.sink = front
    try:
        workload = _workload(engine, seed, requests)
        side0 = sidecar.cpu_seconds()  # its own process_time: /proc's 10 ms ticks read 0
        wall0, cpu0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
        results = drive(engine, workload, max_requests=requests)
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        sidecar.drain(timeout_s=120)
        process_cpu = time.process_time() - proc0
        side = sidecar.cpu_seconds() - side0
        counts = sidecar.summary()
    finally:
        sidecar.stop()
    return {"wall_s": wall, "engine_cpu_s": cpu, "process_cpu_s": process_cpu,
            "sidecar_cpu_s": side, "requests": len(results),
            "prompt_tokens": sum(r.prompt_tokens for r in results), "hits": counts["hits"],
            "samples": counts["sampled"], "verify_latency_s": [], "lookup_ns": lookup_ns,
            "sampled": lookup_sampled}


def _time_verdicts(monitor: Monitor, out: list[float]) -> None:
    """Sampled hit (capture) to verdict applied, per verdict."""
    apply = monitor.apply

    def timed(verdict: Verdict) -> None:
        out.append(time.time() - verdict.sample.captured_at)
        apply(verdict)

    monitor.apply = timed  # type: ignore[method-assign]


def _time_lookups(sink: Any, out: list[int], sampled: list[bool], take: str) -> None:
    """Per lookup: ns on the engine thread, and whether it was sampled (``take``: the
    sink's method a sampled hit goes through: the Monitor's ``_enqueue``, the front's
    ``_sampled``), so the tail of unsampled hooks is reported apart from sampled ones."""
    on_lookup = sink.on_lookup
    taking = getattr(sink, take)
    flag = [False]

    def took(*args: Any) -> None:
        flag[0] = True
        taking(*args)

    def timed(lookup: Lookup) -> None:
        flag[0] = False
        t0 = time.perf_counter_ns()
        on_lookup(lookup)
        out.append(time.perf_counter_ns() - t0)
        sampled.append(flag[0])

    setattr(sink, take, took)
    sink.on_lookup = timed


def engine_overhead(requests: int, repeats: int) -> dict[str, Any]:
    """Detached vs N=1000 vs N=100 (steady state), and N=1000 right after a start (its
    burst), interleaved per repeat so drift hits all alike."""
    torch.manual_seed(0)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ENGINE_RUNS}
    run_engine(max(requests // 4, 1), None)  # warm-up: first-call costs are no one's
    for i in range(repeats):
        # Rotated each repeat: a fixed order puts whatever one run leaves behind (its
        # garbage, a stopped sidecar's threads) always into the same next run.
        for name in ENGINE_RUNS[i % len(ENGINE_RUNS):] + ENGINE_RUNS[:i % len(ENGINE_RUNS)]:
            gc.collect()
            runs[name].append(run_engine(requests, **ENGINE_CONFIGS[name]))
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        out[name] = {
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "engine_cpu_s": statistics.median(r["engine_cpu_s"] for r in rs),
            "process_cpu_s": statistics.median(r["process_cpu_s"] for r in rs),
            "wall_spread": [min(r["wall_s"] for r in rs), max(r["wall_s"] for r in rs)],
            "cpu_spread": [min(r["engine_cpu_s"] for r in rs),
                           max(r["engine_cpu_s"] for r in rs)],
            "process_cpu_spread": [min(r["process_cpu_s"] for r in rs),
                                   max(r["process_cpu_s"] for r in rs)],
            "requests": rs[0]["requests"], "prompt_tokens": rs[0]["prompt_tokens"],
            # dispatch=process: the sidecar process's CPU, apart from the engine's
            "sidecar_cpu_s": (statistics.median(r["sidecar_cpu_s"] for r in rs)
                              if "sidecar_cpu_s" in rs[0] else None),
            # per run: what each configuration really sampled (N=1000 must not be the burst)
            "hits": [r["hits"] for r in rs], "samples": [r["samples"] for r in rs],
        }
    # Ratios per interleaved repeat (detached / attached of the same repeat): their spread
    # is what load does to the ratio itself.
    for name in ENGINE_RUNS[1:]:
        for clock in ("wall_s", "engine_cpu_s", "process_cpu_s"):
            ratios = [d[clock] / a[clock]
                      for d, a in zip(runs["detached"], runs[name], strict=True)]
            out[name][f"ratio_{clock}"] = {"median": statistics.median(ratios),
                                           "min": min(ratios), "max": max(ratios)}
    return out


def verification_latency(requests: int) -> dict[str, Any]:
    """Sampled hit to verdict (P50/P99) at 1 in 10 with an unlimited recompute budget, next
    to one from-scratch prefill of a median verified prefix on the same model."""
    run = run_engine(requests, 10, unlimited_budget=True)
    lat = sorted(run["verify_latency_s"])
    engine = _engine(0)
    tokens = [3 + (7 * i) % 200 for i in range(256)]
    engine.model.prefill(tokens, "")
    prefill = []
    for _ in range(5):
        t0 = time.perf_counter()
        engine.model.prefill(tokens, "")
        prefill.append(time.perf_counter() - t0)
    return {"verdicts": len(lat), "p50_s": _pct(lat, 0.50), "p99_s": _pct(lat, 0.99),
            "prefill_256_tokens_s": statistics.median(prefill)}


def hook_tail_latency(requests: int, repeats: int = 1, dispatch: str = "queued"
                      ) -> dict[str, Any]:
    """Per-call on_lookup latency on the engine thread, same workload: the unsampled hooks
    while the verifier works (1 in 2 sampled, unlimited budget) vs idle (nothing
    sampled); the sampled lookups of the busy run (their capture at match time) apart.
    Per repeat one busy and one idle run, interleaved; each percentile with its spread."""
    busy: list[dict[str, float]] = []
    sampled: list[dict[str, float]] = []
    idle: list[dict[str, float]] = []
    for _ in range(repeats):
        run = run_engine(requests, 2, time_lookups=True, unlimited_budget=True,
                         dispatch=dispatch)
        pairs = list(zip(run["lookup_ns"], run["sampled"], strict=True))
        busy.append(_tail([ns for ns, s in pairs if not s]))
        sampled.append(_tail([ns for ns, s in pairs if s]))
        idle.append(_tail(run_engine(requests, 10**9, time_lookups=True,
                                     dispatch=dispatch)["lookup_ns"]))
    return {"busy_unsampled": _spread(busy), "sampled": _spread(sampled),
            "idle": _spread(idle)}


def _spread(tails: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Median of each percentile over repeats, and its min..max."""
    out: dict[str, Any] = {}
    for k in tails[0]:
        vals = [t[k] for t in tails]
        out[k] = statistics.median(vals)
        out[f"{k}_spread"] = [min(vals), max(vals)]
    return out


def _tail(ns: Sequence[int]) -> dict[str, float]:
    s = sorted(ns)
    return {"calls": len(s), "p50_ns": _pct(s, 0.5), "p99_ns": _pct(s, 0.99),
            "p999_ns": _pct(s, 0.999)}


def _pct(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[i])
