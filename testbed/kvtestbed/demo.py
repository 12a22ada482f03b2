"""The demo: the reference engine under a chat workload, kv-sidecar attached, a fault to catch.

Everything is real except the model's size: a paged prefix cache over a tiny random-init
Llama, the sidecar's Monitor in-process (hooks on the engine's cache events), the verifier on
its own thread, allocator polling on APScheduler, and /metrics on 127.0.0.1.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Result
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from sidecar.adapters.remote.process import SidecarProcess
from sidecar.core.health import monitor_health
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.export.server import SidecarServer
from sidecar.signals import THRESHOLDS

# The reference engines' calibration profile, written by `kv-sidecar calibrate` (README,
# Tolerances); `tests/test_calibration_profile.py` checks it is current.
SHIPPED_PROFILE = Path(__file__).resolve().parent / "engines" / "calibration.json"


@dataclass
class DemoOptions:
    fault: str = "none"
    model: str = "reference"  # reference | hybrid | recurrent (hybrid_model.py)
    dtype: str = "float32"
    requests: int = 400
    sample_every: int = 4
    seed: int = 0
    port: int = 9464
    hold_s: float = 0.0
    pace_s: float = 0.0
    evidence_dir: str | None = None
    otel: str = "none"
    # OTLP/HTTP push of metrics and spans (sidecar.export.otel_push)
    otlp_endpoint: str | None = None
    otlp_interval_s: float = 10.0
    otlp_protocol: str = "http/protobuf"
    progress: bool = True
    num_blocks: int = 256
    device: str = "cpu"  # the engine's model and KV ("cuda" needs a CUDA device)
    token: str | None = None  # bearer token for /status (the CLI reads $KVSIDECAR_TOKEN)
    # Extra SidecarConfig fields (the tolerance flags: tolerances, calibration_samples, ...).
    sidecar: dict[str, Any] = field(default_factory=dict)


class Progress:
    """One line on stderr, rewritten in place on a terminal and every 10% elsewhere."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last_decile = -1
        self.started = time.monotonic()

    def update(self, done: int, monitor: Monitor | SidecarProcess) -> None:
        if not self.enabled:
            return
        decile = done * 10 // max(self.total, 1)
        if not self.tty and decile == self._last_decile and done != self.total:
            return
        self._last_decile = decile
        s = monitor.summary()
        anomalies = sum(s["anomalies"].values())
        line = (f"[{done:>5}/{self.total}] hit rate {s['token_hit_rate']:.0%} (tokens)  "
                f"verified {s['verified']}  anomalies {anomalies}  "
                f"{time.monotonic() - self.started:5.1f}s")
        end = "\r" if self.tty and done != self.total else "\n"
        print(line, end=end, file=sys.stderr, flush=True)


def sidecar_config(opts: DemoOptions) -> SidecarConfig:
    """The demo's sidecar settings, for every model; a config file, the environment and
    flags (``opts.sidecar``) override them. Unless told otherwise the tolerance starts from
    the reference engines' shipped calibration profile (:data:`SHIPPED_PROFILE`, measured
    by ``kv-sidecar calibrate`` on the clean engines): the demo's fault starts at request
    ~20, before 64 clean blocks could be learnt, and learning from the faulty engine would
    teach the fault's error as noise. ``calibration_profile=""``: no profile."""
    fields = dict(opts.sidecar)
    profile = fields.pop("calibration_profile", None)
    return SidecarConfig(**{**dict(
        sample_every=opts.sample_every, seed=opts.seed, evidence_dir=opts.evidence_dir,
        recompute_tokens_per_s=0,
        # check the allocator after every release: the demo reports the request at which
        # each fault was caught
        allocator_check_min_interval_s=0.0, allocator_every_s=0.5), **fields,
        "calibration_profile": str(SHIPPED_PROFILE) if profile is None else profile or None})


def engine_and_adapter(opts: DemoOptions) -> tuple[Any, Any]:
    """The demo's engine for ``opts.model`` and its adapter: the reference paged engine
    (with write-time digests), or for ``hybrid|recurrent`` the hybrid engine (one pool per
    cache group, no write-time digest: it keeps none)."""
    if opts.model == "reference":
        engine = ReferenceEngine(EngineConfig(
            model=ModelConfig(dtype=opts.dtype, seed=opts.seed), num_blocks=opts.num_blocks,
            fault=opts.fault, fault_seed=opts.seed, kv_digest=True, device=opts.device))
        return engine, ReferenceAdapter(engine)
    from kvtestbed.adapters.hybrid_adapter import HybridReferenceAdapter
    from kvtestbed.engines.hybrid_engine import HybridEngine
    from kvtestbed.engines.hybrid_model import model_config

    if opts.device != "cpu":
        raise ValueError(f"--model {opts.model} runs on the CPU only (got --device "
                         f"{opts.device}); the reference model runs on CUDA")
    hybrid = HybridEngine(EngineConfig(
        model=model_config(opts.model, opts.dtype, opts.seed), model_kind=opts.model,
        num_blocks=opts.num_blocks, fault=opts.fault, fault_seed=opts.seed))
    return hybrid, HybridReferenceAdapter(hybrid)


def build(opts: DemoOptions) -> tuple[ReferenceEngine, Monitor]:
    """The demo's engine with the sidecar attached in-process (also used by tests and the
    bench)."""
    engine, adapter = engine_and_adapter(opts)
    monitor = Monitor(adapter, sidecar_config(opts))
    engine.sink = monitor
    return engine, monitor


def build_process(opts: DemoOptions) -> tuple[ReferenceEngine, SidecarProcess]:
    """``dispatch = "process"``: the engine with only the sidecar's front in its process;
    the sidecar process serves ``/metrics`` on ``opts.port`` (started here)."""
    if opts.otel != "none" or opts.otlp_endpoint:
        raise ValueError("--otel and --otlp-endpoint export from the Monitor's process; with "
                         "dispatch = 'process' scrape the sidecar process's /metrics instead")
    engine, adapter = engine_and_adapter(opts)
    sidecar = SidecarProcess(adapter, sidecar_config(opts), port=opts.port,
                             token=opts.token).start()
    engine.sink = sidecar.front
    return engine, sidecar


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    if sidecar_config(opts).dispatch == "process":
        return run_process_demo(opts)
    engine, monitor = build(opts)
    otel = None
    if opts.otel == "console":
        from sidecar.export.otel import OtelExporter, console_exporter
        otel = OtelExporter(monitor.metrics.registry, console_exporter()).start()
    push = None
    if opts.otlp_endpoint:
        from sidecar.export.otel_push import start_otlp_push
        push = start_otlp_push(monitor, opts.otlp_endpoint, opts.otlp_interval_s,
                               opts.otlp_protocol)
    server = SidecarServer(monitor.metrics.registry, monitor.summary, port=opts.port,
                           health=lambda: monitor_health(monitor), token=opts.token).start()
    if opts.progress:
        print(f"kv-sidecar demo: fault={opts.fault} dtype={opts.dtype} "
              f"requests={opts.requests} sample 1/{opts.sample_every}; "
              f"metrics at {server.url}/metrics", file=sys.stderr, flush=True)
    monitor.start()
    try:
        summary = drive_and_summarize(engine, opts, monitor)
        if opts.hold_s > 0:
            if opts.progress:
                print(f"holding {server.url}/metrics for {opts.hold_s:g}s", file=sys.stderr,
                      flush=True)
            time.sleep(opts.hold_s)
        return summary
    finally:
        monitor.stop()
        server.stop()
        if otel is not None:
            otel.shutdown()
        if push is not None:
            push.shutdown()


def drive_and_summarize(engine: ReferenceEngine, opts: DemoOptions,
                        monitor: Monitor | SidecarProcess) -> dict[str, Any]:
    """The seeded chat workload through ``engine`` (progress shown), then the sidecar's
    summary once it has verified everything and checked the allocator a last time, with
    what only the demo knows (:func:`demo_extras`). The fault's start is counted in
    requests completed (the monitor's count, the unit of every "request index" in the
    summary) before the step in which the fault first acted: a lower bound, so the
    detection delays reported from it are never too short."""
    progress = Progress(opts.requests, opts.progress)
    workload = ChatWorkload(WorkloadConfig(seed=opts.seed,
                                           conversations=max(8, opts.requests // 3 + 8),
                                           block_size=engine.block_size))
    done = seen_done = 0
    fault_start: int | None = None

    def on_result(result: Result) -> None:
        nonlocal done, seen_done, fault_start
        done += 1
        if fault_start is None and getattr(engine.fault, "injections", None):
            fault_start = seen_done
        seen_done = monitor.requests_done
        progress.update(done, monitor)
        if opts.pace_s:
            time.sleep(opts.pace_s)

    drive(engine, workload, max_requests=opts.requests, on_result=on_result)
    monitor.drain(timeout_s=120)
    monitor.poll_allocator()
    summary = monitor.summary()
    summary.update(demo_extras(engine, opts, summary, fault_start))
    return summary


def run_process_demo(opts: DemoOptions) -> dict[str, Any]:
    """The demo with ``dispatch = "process"``: the same drive and summary, the Monitor in a
    sidecar process of its own (:mod:`sidecar.adapters.remote`)."""
    engine, sidecar = build_process(opts)
    if opts.progress:
        print(f"kv-sidecar demo: fault={opts.fault} dtype={opts.dtype} "
              f"requests={opts.requests} sample 1/{opts.sample_every}, sidecar in process "
              f"{sidecar.process.pid}; metrics at {sidecar.url}/metrics", file=sys.stderr,
              flush=True)
    try:
        summary = drive_and_summarize(engine, opts, sidecar)
        summary["dispatch"] = "process"
        if opts.hold_s > 0:
            time.sleep(opts.hold_s)
        return summary
    finally:
        sidecar.stop()


def demo_extras(engine: ReferenceEngine, opts: DemoOptions,
                summary: dict[str, Any] | None = None,
                fault_start: int | None = None) -> dict[str, Any]:
    """What only the demo knows: the fault, when it started acting, and how many requests
    later each of the sidecar's signals fired (request indexes count completed requests)."""
    fault = engine.fault
    s = summary or {}

    def delay(key: str) -> int | None:
        at = s.get(key)
        return at - fault_start if at is not None and fault_start is not None else None

    groups = getattr(engine, "group_stats", None)
    return {
        "fault": opts.fault,
        "model_kind": opts.model,  # reference | hybrid | recurrent ("model": its name)
        # per cache group: hits it served, real blocks and null (padding) blocks in them
        "groups": ({name: dict(c) for name, c in groups.items()} if groups is not None
                   else {"full": {"hits": s.get("hits"), "null_blocks": 0}}),
        "seed": opts.seed,
        "sample_every": opts.sample_every,
        "fault_injections": len(getattr(fault, "injections", ())),
        "rejected_requests": engine.stats.get("rejected", 0),
        "fault_start_request": fault_start,
        "detection_delay_requests": {
            "invariant": delay("first_invariant_violation_request"),
            "content": delay("first_content_anomaly_request"),
            "leak": delay("first_leak_suspected_request"),
        },
    }


def _pct(ratio: float | None) -> str:
    return "unknown" if ratio is None else f"{ratio:.1%}"


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable table: hit rate next to what the sidecar found under it."""
    t = THRESHOLDS
    anomalies = s["anomalies"]
    p99 = s["p99_latency_seconds"]
    rows = [
        ("engine / model / dtype", f"{s['engine']} / {s['model']} / {s['dtype']}"),
        ("fault injected", f"{s['fault']} ({s['fault_injections']} injections)"),
        ("requests", f"{s['requests']}"),
        ("hit rate (lookups)", f"{s['hit_rate']:.1%}"),
        ("hit rate (tokens)", f"{s['token_hit_rate']:.1%}"
         + ("   below threshold!" if s["token_hit_rate"] < t.hit_rate_low else "")),
        ("sampled hits / blocks verified", f"{s['sampled']} / {s['verified']}"),
        ("content anomalies", ", ".join(f"{k}={v}" for k, v in sorted(anomalies.items()))
         or "none"),
        ("content-anomaly rate", f"{s['anomaly_rate']:.2%}"),
        ("samples dropped", ", ".join(f"{k}={v:g}" for k, v in sorted(s["dropped"].items())
                                      if v) or "none"),
        *_allocator_rows(s),
        ("P99 request latency", f"{p99 * 1000:.1f} ms" if p99 is not None else "n/a"),
        ("max recompute error (tol)", f"{s['max_recompute_error']:.2g} "
                                      f"({s['tolerance']:.2g})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    verdicts = []
    if anomalies:
        verdicts.append("CAUGHT: the cache served wrong KV while the hit rate looked healthy")
    if s["invariant_violations"] or s["leak_suspected"]:
        verdicts.append("CAUGHT: the block allocator broke its invariants"
                        + (" and leaks blocks" if s["leak_suspected"] else ""))
    if s["allocator_thresholds_exceeded"]:
        verdicts.append("WARNING: allocator above its alert thresholds: "
                        + ", ".join(s["allocator_thresholds_exceeded"]))
    if not verdicts and not s["verified"]:  # "clean" would claim a check that never ran
        verdicts.append("NOT CHECKED: no block was verified (too few hits sampled: lower "
                        "--sample-every or run more requests); the allocator kept its invariants")
    elif not verdicts:
        verdicts.append("clean: every verified hit matched its recompute, the allocator kept "
                        "its invariants")
    return "\n".join([*lines, "", *verdicts])


def _allocator_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Allocator health rows: counts, invariants and leak, each with its delay after the
    fault started."""
    t = THRESHOLDS
    delays = s.get("detection_delay_requests") or {}

    def at(key: str, kind: str) -> str:
        if s.get(key) is None:
            return "never"
        d = delays.get(kind)
        return f"{s[key]}" + (f" ({d} requests after the fault started)" if d is not None
                              else "")

    def flag(value: float, limit: float) -> str:
        return "   above threshold!" if value > limit else ""

    violations = s["invariant_violations"]
    leak = (f"yes: {s['leak_suspected_blocks']} blocks held by no live sequence"
            if s["leak_suspected"] else "no")
    return [
        ("fault started at request", "never" if s.get("fault_start_request") is None
         else str(s["fault_start_request"])),
        ("first anomaly at request", at("first_content_anomaly_request", "content")),
        ("allocator invariant checks", str(s["invariant_checks"])),
        ("invariant violations", ", ".join(f"{k}={v}" for k, v in sorted(violations.items()))
         or "none"),
        ("first violation at request", at("first_invariant_violation_request", "invariant")),
        ("leak suspected", leak),
        ("leak flagged at request", at("first_leak_suspected_request", "leak")),
        ("allocation failures", f"{s['allocation_failures']} of {s['allocations']} "
         f"({s['allocation_failure_rate']:.2%})"
         + flag(s["allocation_failure_rate"], t.allocation_failure_rate)),
        ("usage (now / peak)", f"{_pct(s['usage_ratio'])} / {s['max_usage_ratio']:.1%}"
         + flag(s["max_usage_ratio"], t.usage_ratio)),
        ("fragmentation (now / peak)", f"{_pct(s['fragmentation_ratio'])} / "
         f"{s['max_fragmentation_ratio']:.1%}"
         + flag(s["max_fragmentation_ratio"], t.fragmentation_ratio)),
    ]
