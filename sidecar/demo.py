"""The demo: the reference engine under a chat workload, kv-sidecar attached, a fault to catch.

Everything is real except the model's size: a paged prefix cache over a tiny random-init
Llama, the sidecar's Monitor in-process (hooks on the engine's cache events), the verifier on
its own thread, allocator polling on APScheduler, and /metrics on 127.0.0.1.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from sidecar.adapters.reference import ReferenceAdapter
from sidecar.engines.reference.engine import EngineConfig, ReferenceEngine, Result
from sidecar.engines.reference.model import ModelConfig
from sidecar.engines.reference.workload import ChatWorkload, WorkloadConfig, drive
from sidecar.jobs import Jobs
from sidecar.monitor import Monitor, SidecarConfig
from sidecar.server import SidecarServer
from sidecar.signals import THRESHOLDS


@dataclass
class DemoOptions:
    fault: str = "none"
    dtype: str = "float32"
    requests: int = 400
    sample_every: int = 4
    seed: int = 0
    port: int = 9464
    hold_s: float = 0.0
    pace_s: float = 0.0
    evidence_dir: str | None = None
    otel: str = "none"
    progress: bool = True
    num_blocks: int = 256


class Progress:
    """One line on stderr, rewritten in place on a terminal and every 10% elsewhere."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last_decile = -1
        self.started = time.monotonic()

    def update(self, done: int, monitor: Monitor) -> None:
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


def build(opts: DemoOptions) -> tuple[ReferenceEngine, Monitor]:
    """The reference engine with the sidecar attached (also used by tests and the bench)."""
    engine = ReferenceEngine(EngineConfig(
        model=ModelConfig(dtype=opts.dtype, seed=opts.seed), num_blocks=opts.num_blocks,
        fault=opts.fault, fault_seed=opts.seed, kv_digest=True))
    monitor = Monitor(ReferenceAdapter(engine),
                      SidecarConfig(sample_every=opts.sample_every, seed=opts.seed,
                                    evidence_dir=opts.evidence_dir,
                                    recompute_tokens_per_s=0))
    engine.sink = monitor
    return engine, monitor


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    engine, monitor = build(opts)
    mirror = None
    if opts.otel == "console":
        from sidecar.otel import OtelMirror, console_reader
        mirror = OtelMirror(monitor.metrics, [console_reader()])
    server = SidecarServer(monitor.metrics.registry, monitor.summary, port=opts.port).start()
    if opts.progress:
        print(f"kv-sidecar demo: fault={opts.fault} dtype={opts.dtype} "
              f"requests={opts.requests} sample 1/{opts.sample_every}; "
              f"metrics at {server.url}/metrics", file=sys.stderr, flush=True)
    jobs = Jobs(monitor, allocator_every_s=0.5).start()
    monitor.start()
    progress = Progress(opts.requests, opts.progress)
    workload = ChatWorkload(WorkloadConfig(seed=opts.seed,
                                           conversations=max(8, opts.requests // 3 + 8),
                                           block_size=engine.block_size))
    done = 0

    def on_result(result: Result) -> None:
        nonlocal done
        done += 1
        progress.update(done, monitor)
        if opts.pace_s:
            time.sleep(opts.pace_s)

    try:
        drive(engine, workload, max_requests=opts.requests, on_result=on_result)
        monitor.drain(timeout_s=120)
        monitor.poll_allocator()
        summary = monitor.summary()
        summary.update(demo_extras(engine, opts))
        if opts.hold_s > 0:
            if opts.progress:
                print(f"holding {server.url}/metrics for {opts.hold_s:g}s", file=sys.stderr,
                      flush=True)
            time.sleep(opts.hold_s)
        return summary
    finally:
        jobs.stop()
        monitor.stop()
        server.stop()
        if mirror is not None:
            mirror.shutdown()


def demo_extras(engine: ReferenceEngine, opts: DemoOptions) -> dict[str, Any]:
    fault = engine.fault
    return {
        "fault": opts.fault,
        "seed": opts.seed,
        "sample_every": opts.sample_every,
        "fault_injections": len(getattr(fault, "injections", ())),
        "rejected_requests": engine.stats.get("rejected", 0),
    }


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
        ("first anomaly at request", str(s["first_content_anomaly_request"])),
        ("samples dropped", ", ".join(f"{k}={v:g}" for k, v in sorted(s["dropped"].items())
                                      if v) or "none"),
        ("allocation failures", f"{s['allocation_failures']} of {s['allocations']}"),
        ("usage / fragmentation", f"{s['usage_ratio']:.1%} / {s['fragmentation_ratio']:.1%}"),
        ("P99 request latency", f"{p99 * 1000:.1f} ms" if p99 is not None else "n/a"),
        ("max recompute error (tol)", f"{s['max_recompute_error']:.2g} "
                                      f"({s['tolerance']:.2g})"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    verdict = ("CAUGHT: the cache served wrong KV while the hit rate looked healthy"
               if anomalies else "clean: every verified hit matched its recompute")
    return "\n".join([*lines, "", verdict])
