"""``kv-sidecar actions-demo``: the background scrub and the protective actions, shown on the
reference engine (a separate entry point: ``kv-sidecar demo`` stays the detection demo).

* ``--scenario scrub``: a chat workload warms the cache, then idle cached blocks are
  corrupted in place and no request ever hits them again. Only the scrub, on its real
  APScheduler schedule, can find them; the table reports which it found, when, and the
  recompute rate it measured against its budget (tokens per minute, side by side).
* ``--scenario breaker``: the workload runs with quarantine and the circuit breaker on;
  partway through, cached blocks are zeroed. The timeline shows the hit rate per window of
  requests dip to 0 when the breaker opens and recover once M clean probes close it.

Both print a table, or one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Result
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from sidecar import signals as S
from sidecar.checks.verifier import Verdict
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.protect.actions import bad_blocks


@dataclass
class ActionsDemoOptions:
    scenario: str = "breaker"
    requests: int = 300
    seed: int = 0
    corrupt: int = 4  # blocks corrupted
    seconds: float = 25.0  # scrub scenario: how long the scheduled scrub runs
    budget: float = 120_000.0  # scrub tokens per minute
    every_s: float = 0.25  # scrub tick interval
    inject_at: int = 120  # breaker scenario: request after which blocks are corrupted
    window: int = 10  # breaker scenario: requests per timeline row
    probe_every_s: float = 0.5  # breaker scenario: one probe per scrub tick
    anomalies: int = 3  # K
    probes: int = 5  # M


def _engine(opts: ActionsDemoOptions) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model=ModelConfig(seed=opts.seed), num_blocks=256,
                                        kv_digest=False))


def _workload(opts: ActionsDemoOptions, engine: ReferenceEngine) -> ChatWorkload:
    return ChatWorkload(WorkloadConfig(seed=opts.seed, conversations=max(8, opts.requests // 3),
                                       block_size=engine.block_size))


def _corrupt(engine: ReferenceEngine, n: int, rng: random.Random, zero: bool) -> list[int]:
    """``n`` cached (unreferenced, indexed) blocks made wrong in place, under the lock."""
    with engine.lock:
        pool = engine.pool
        cached = [b for b in pool.lists()[1] if pool.blocks[b].prefix_tokens > 0]
        bad = rng.sample(cached, min(n, len(cached)))
        for b in bad:
            if zero:
                pool.key[:, b] = 0.0
                pool.value[:, b] = 0.0
            else:  # one token row of one layer and head shifted: only a recompute sees it
                pool.key[rng.randrange(pool.key.shape[0]), b, 0, rng.randrange(16)] += 0.5
    return bad


def run_scrub(opts: ActionsDemoOptions) -> dict[str, Any]:
    engine = _engine(opts)
    cfg = SidecarConfig(sample_every=10**6, seed=opts.seed, allocator_every_s=0,
                        recompute_tokens_per_s=0, scrub=True, scrub_every_s=opts.every_s,
                        scrub_jitter_s=opts.every_s / 4, scrub_blocks_per_tick=64,
                        scrub_tokens_per_minute=opts.budget, scrub_idle_s=0,
                        scrub_seed=opts.seed)
    monitor = Monitor(ReferenceAdapter(engine), cfg)
    engine.sink = monitor
    drive(engine, _workload(opts, engine), max_requests=opts.requests)
    monitor.journal.drain()
    bad = set(_corrupt(engine, opts.corrupt, random.Random(opts.seed), zero=False))
    scrubber = monitor.scrubber
    assert scrubber is not None
    resident = monitor.stored.resident()
    found: dict[int, float] = {}  # block id -> seconds after the scrub started
    started = time.monotonic()

    def note(verdict: Verdict) -> None:
        for ids in bad_blocks(verdict).values():
            for b in ids:
                found.setdefault(b, round(time.monotonic() - started, 2))
    monitor.verdict_listeners.append(note)
    monitor.start()  # the scheduled scrub; its budget is measured from here
    try:
        time.sleep(opts.seconds)
    finally:
        monitor.stop()
    m = monitor.metrics
    return {
        "scenario": "scrub",
        "resident_blocks": len(resident),
        "resident_recompute_tokens": sum(p + engine.block_size for _, _, p in resident),
        "corrupted_blocks": sorted(bad),
        "found_by_scrub": sorted(bad & set(found)),
        "found_after_seconds": {str(b): t for b, t in sorted(found.items())},
        "false_alarms": sorted(set(found) - bad),
        "sampled_hits": m.value(S.SAMPLED.name),
        "scrub_verified": m.value(S.SCRUB_VERIFIED.name, result="clean")
        + m.value(S.SCRUB_VERIFIED.name, result="anomalous"),
        "scrub_passes": m.value(S.SCRUB_PASSES.name),
        "coverage": m.value(S.SCRUB_COVERAGE.name),
        "seconds": round(time.monotonic() - started, 2),
        "budget_tokens_per_minute": opts.budget,
        "measured_tokens_per_minute": round(scrubber.budget.measured_per_minute(), 1),
        "skipped_budget": m.value(S.SCRUB_SKIPPED.name, reason="budget"),
    }


def run_breaker(opts: ActionsDemoOptions) -> dict[str, Any]:
    engine = _engine(opts)
    cfg = SidecarConfig(sample_every=2, seed=opts.seed, dispatch="inline",
                        allocator_every_s=0, recompute_tokens_per_s=0, blocks_per_sample=4,
                        quarantine=True, breaker=True, breaker_anomalies=opts.anomalies,
                        breaker_probes=opts.probes, scrub_every_s=opts.probe_every_s,
                        scrub_jitter_s=0.0, scrub_blocks_per_tick=1, scrub_idle_s=0,
                        scrub_tokens_per_minute=1e8, scrub_seed=opts.seed)
    monitor = Monitor(ReferenceAdapter(engine), cfg)
    engine.sink = monitor
    breaker = monitor.actions.breaker
    assert breaker is not None
    rng = random.Random(opts.seed)
    rows: list[dict[str, Any]] = []
    window: list[Result] = []
    state = {"done": 0, "open_seen": False}

    def on_result(result: Result) -> None:
        state["done"] += 1
        window.append(result)
        state["open_seen"] = state["open_seen"] or breaker.open
        if state["done"] == opts.inject_at:
            _corrupt(engine, opts.corrupt, rng, zero=True)
        if len(window) == opts.window:
            q = sum(r.prompt_tokens for r in window)
            rows.append({"requests": f"{state['done'] - opts.window}-{state['done'] - 1}",
                         "hit_rate": sum(r.hit_tokens for r in window) / q if q else 0.0,
                         "breaker": "open" if breaker.open else
                         ("opened+closed" if state["open_seen"] else "closed")})
            window.clear()
            state["open_seen"] = breaker.open
        if breaker.open:
            time.sleep(0.01)  # a live engine keeps serving; give the probes wall time

    monitor.start()
    try:
        drive(engine, _workload(opts, engine), max_requests=opts.requests, on_result=on_result)
    finally:
        monitor.stop()
    m = monitor.metrics
    return {"scenario": "breaker", "inject_after_request": opts.inject_at,
            "corrupted_blocks": opts.corrupt, "k_anomalies": opts.anomalies,
            "m_probes": opts.probes, "trips": breaker.trips,
            "probes_clean": m.value(S.BREAKER_PROBES.name, result="clean"),
            "probes_anomalous": m.value(S.BREAKER_PROBES.name, result="anomalous"),
            "quarantined": m.value(S.QUARANTINED.name, result="evicted"),
            "anomalies": m.value_sum(S.ANOMALIES.name), "timeline": rows}


def format_result(r: dict[str, Any]) -> str:
    if r["scenario"] == "scrub":
        rows = [(k.replace("_", " "), str(v)) for k, v in r.items() if k != "scenario"]
        width = max(len(k) for k, _ in rows)
        ok = set(r["found_by_scrub"]) == set(r["corrupted_blocks"]) and not r["false_alarms"]
        within = r["measured_tokens_per_minute"] <= r["budget_tokens_per_minute"]
        return "\n".join([*(f"{k:<{width}}  {v}" for k, v in rows), "",
                          ("FOUND: every corrupted idle block, by the scrub alone" if ok
                           else "NOT ALL FOUND: raise --seconds or --budget"),
                          f"recompute rate {'within' if within else 'OVER'} budget: "
                          f"{r['measured_tokens_per_minute']:.0f} vs "
                          f"{r['budget_tokens_per_minute']:.0f} tokens/min"])
    head = {k: v for k, v in r.items() if k not in ("timeline", "scenario")}
    lines = [", ".join(f"{k}={v}" for k, v in head.items()), "",
             f"{'requests':<10} {'hit rate':>8}  breaker"]
    for row in r["timeline"]:
        bar = "#" * round(row["hit_rate"] * 40)
        lines.append(f"{row['requests']:<10} {row['hit_rate']:>8.0%}  {row['breaker']:<13} "
                     f"{bar}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for name in ("requests", "corrupt"):
        if getattr(args, name) < 1:
            print(f"kv-sidecar: error: --{name} must be >= 1", file=sys.stderr)
            return 2
    if not args.seconds > 0 or not args.budget > 0:
        print("kv-sidecar: error: --seconds and --budget must be > 0", file=sys.stderr)
        return 2
    opts = ActionsDemoOptions(scenario=args.scenario, requests=args.requests, seed=args.seed,
                              corrupt=args.corrupt, seconds=args.seconds, budget=args.budget)
    result = run_scrub(opts) if opts.scenario == "scrub" else run_breaker(opts)
    print(json.dumps(result, indent=1, sort_keys=True) if args.json else format_result(result))
    return 0
