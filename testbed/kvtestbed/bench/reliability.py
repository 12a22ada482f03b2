"""``kv-sidecar bench reliability``: can any input, adapter or peer crash, blind or poison
the sidecar (issue 12)? Prints what was tried, how many cases, what survived, what escaped
and what was lost (both must be 0), and with ``--json`` one JSON object.

* fuzzers (:mod:`kvtestbed.bench.fuzz`): >= 100k seeded mutation cases per decoder: KV
  events, probe wire, hook objects, HTTP requests; sampled hits with hostile insides (token
  ids, group maps: :mod:`kvtestbed.bench.fuzz_hits`) verified inline, each accounted for;
* floods: engine-thread hook latency (p99) under a hostile flood vs a clean one, measured
  side by side; KV event series count under hostile label values; idle-connection and
  scraper floods against the HTTP server;
* adapter faults: raise, hang, garbage, SystemExit from a real (reference-engine) adapter
  while traffic runs: the verifier must stay alive and every sample be accounted for;
* >= 20 SIGKILL/restart cycles of a process writing evidence into one directory: no
  partial record, no overwritten record, no record lost inside the retention window;
* surfaces that face the world (issue 21, :mod:`kvtestbed.bench.surfaces`): the evidence
  reader and writer, the canary against a hostile server, OTLP receivers that are down,
  silent or failing; each case checked (verified, refused with a message, or counted),
  tracebacks logged meanwhile counted, RSS growth bounded.

The full run takes a few minutes on 2 cores; ``--quick`` (seconds) is in the test suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any

from kvtestbed.bench.evidence_kill import kill_cycles
from kvtestbed.bench.exit_now import exit_now
from kvtestbed.bench.floods import good_lookup, hook_flood, http_flood, label_flood, reference
from kvtestbed.bench.fuzz import FuzzResult, fuzz_events, fuzz_hooks, fuzz_http, fuzz_probe
from sidecar import signals as S

FULL_CASES = 100_000
CONFIG_ROWS = {"config_files", "config_env", "bearer_auth"}  # kvtestbed.bench.surface_http
HOOK_RATIO_CHECK = "hook flood: hostile/clean p99 ratio <= 2"


# ---------------------------------------------------------------- world-facing surfaces
def surfaces() -> list[Any]:
    """Each a ``(quick, seed) -> SurfaceResult`` (:mod:`kvtestbed.bench.surfaces`)."""
    from kvtestbed.bench.surface_canary import canary_server
    from kvtestbed.bench.surface_evidence import evidence_reader, evidence_writer
    from kvtestbed.bench.surface_otlp import otlp_endpoints

    found: list[Any] = [evidence_reader, evidence_writer, canary_server, otlp_endpoints]
    # (HTTP/config surfaces: append theirs here)
    return found


# ---------------------------------------------------------------- adapter faults
class FaultyAdapter:
    """The real reference adapter, with faults injected per call: raise, hang, garbage,
    SystemExit, KeyboardInterrupt, or fine."""

    FAULTS = ("raise", "hang", "garbage", "system_exit", "keyboard_interrupt", "ok", "ok")

    def __init__(self, inner: Any, seed: int) -> None:
        self.inner = inner
        self.rng = random.Random(seed)
        self.release = threading.Event()
        self.injected: dict[str, int] = {}

    def describe(self) -> Any:
        return self.inner.describe()

    def _fault(self, op: str, real: Any, *args: Any) -> Any:
        f = self.rng.choice(self.FAULTS)
        self.injected[f] = self.injected.get(f, 0) + 1
        if f == "raise":
            raise RuntimeError(f"{op} exploded")
        if f == "hang":
            self.release.wait(0.3)  # past the 0.05 s limit, short enough to clear
        if f == "garbage":
            return [object(), None, "junk"]
        if f == "system_exit":
            raise SystemExit(3)
        if f == "keyboard_interrupt":
            raise KeyboardInterrupt
        return real(*args)

    def read(self, hit: Any, refs: Any) -> Any:
        return self._fault("read", self.inner.read, hit, refs)

    def recompute(self, hit: Any, refs: Any) -> Any:
        return self._fault("recompute", self.inner.recompute, hit, refs)

    def allocator(self) -> Any:
        return self._fault("allocator", self.inner.allocator)


def adapter_faults(requests: int, seed: int = 0) -> FuzzResult:
    from kvtestbed.adapters.paged_adapter import ReferenceAdapter
    from kvtestbed.engines.engine import EngineConfig, ReferenceEngine, Request
    from kvtestbed.engines.model import ModelConfig
    from sidecar.core.health import monitor_health
    from sidecar.core.monitor import Monitor, SidecarConfig

    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype="float32", seed=0),
                                          num_blocks=128, kv_digest=True))
    faulty = FaultyAdapter(ReferenceAdapter(engine), seed)
    mon = Monitor(faulty, SidecarConfig(sample_every=1, adapter_timeout_s=0.05,
                                        recompute_tokens_per_s=0, queue_size=1024,
                                        allocator_check_min_interval_s=-1))
    engine.sink = mon
    applied = [0]
    real_apply = mon.apply

    def counting_apply(verdict: Any) -> None:
        applied[0] += 1
        real_apply(verdict)

    mon.apply = counting_apply  # type: ignore[method-assign]
    res = FuzzResult("adapter_faults", "raise/hang/garbage/SystemExit/KeyboardInterrupt "
                                       "from read, recompute, allocator")
    mon.start()
    rng = random.Random(seed)
    base = list(range(1, 33))
    try:
        for i in range(requests):
            res.cases += 1
            try:
                engine.serve(Request(base + [rng.randint(40, 90) for _ in range(i % 3)],
                                     max_new_tokens=1))
                if i % 10 == 0:
                    mon.poll_allocator()
                res.survived += 1
            except Exception:
                res.escaped += 1
        drained = mon.drain(60)
        m = mon.metrics
        sampled = m.value(S.SAMPLED.name)
        accounted = applied[0] + m.value(S.SAMPLES_DROPPED.name, reason="queue_full")
        res.lost = int(sampled - accounted) + (0 if drained else 1)
        if not monitor_health(mon)["ok"]:
            res.lost += 1  # the verifier thread died
    finally:
        faulty.release.set()
        mon.stop()
        # Abandoned (timed-out) adapter calls still run on daemon threads: let them end
        # before the interpreter does (torch aborts a process exiting under a live call).
        deadline = time.monotonic() + 30
        while mon.guard.stuck and time.monotonic() < deadline:
            time.sleep(0.05)
    res.tried += f" ({', '.join(f'{k}={v}' for k, v in sorted(faulty.injected.items()))})"
    return res


# ---------------------------------------------------------------- the command
def _progress(what: str) -> None:
    print(f"bench reliability: {what} ...", file=sys.stderr, flush=True)


def run_all(quick: bool, seed: int = 0, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every stage, each result kept in ``out`` as soon as it is measured (a run stopped by
    a signal reports what it has: :func:`finish`)."""
    out = {} if out is None else out
    out.update({"quick": quick, "seed": seed, "started": time.perf_counter(), "rows": [],
                "surfaces": []})
    # A traceback the sidecar logs in any stage is a bug the run found, even when caught.
    from kvtestbed.bench.surfaces import TracebackCounter

    counter = out["_tracebacks"] = TracebackCounter()
    logging.getLogger("sidecar").addHandler(counter)
    try:
        return _stages(out, quick, seed)
    finally:
        logging.getLogger("sidecar").removeHandler(counter)


def _stages(out: dict[str, Any], quick: bool, seed: int) -> dict[str, Any]:
    n = 1000 if quick else FULL_CASES
    rows: list[FuzzResult] = []
    out["_rows"] = rows
    _progress(f"kv_events, probe_wire ({n} cases each)")
    rows += [fuzz_events(n, seed), fuzz_probe(n, seed + 1)]
    engine, mon = reference(sample_every=50)
    mon.start()
    try:
        _progress("hook_objects, http_requests")
        rows.append(fuzz_hooks(mon, good_lookup(engine), n, seed + 2))
        from sidecar.core.health import monitor_health
        from sidecar.export.server import SidecarServer

        srv = SidecarServer(mon.metrics.registry, mon.summary, port=0,
                            health=lambda: monitor_health(mon), timeout_s=1.0)
        try:
            rows.append(fuzz_http(srv, max(n // 5, 200) if quick else n, seed + 3))
        finally:
            srv.httpd.server_close()
        json.dumps(mon.summary(), allow_nan=False)  # state not poisoned by the fuzz
    finally:
        mon.stop()
    from kvtestbed.bench.fuzz_hits import fuzz_hit_shapes  # verified inline: ~10 ms a case

    _progress("hit_shapes")
    rows.append(fuzz_hit_shapes(300 if quick else 5000, seed + 8))
    _progress("adapter_faults")
    rows.append(adapter_faults(40 if quick else 400, seed + 4))
    _progress("evidence_sigkill")
    rows.append(kill_cycles(3 if quick else 20, seed=seed + 5))
    from kvtestbed.bench.reliability_proxy import proxy_surface  # the replay proxy (guard)

    _progress("replay proxy")
    proxy_row, out["replay_proxy"] = proxy_surface(300 if quick else 10_000, seed + 7)
    rows.append(proxy_row)
    _progress("floods")
    floods: dict[str, Any] = {}
    out["floods"] = floods
    floods["hook_latency"] = hook_flood(2000 if quick else 50_000, seed + 6)
    floods["labels"] = label_flood(500 if quick else 10_000)
    floods["http"] = http_flood(50 if quick else 300, 20 if quick else 200)
    from kvtestbed.bench.surfaces import run_surface

    results: list[Any] = []
    out["_surfaces"] = results
    for i, f in enumerate(surfaces()):
        results.append(run_surface(f, quick, seed + 10 + i))
    # issue 21: config files and env, bearer auth, slow clients, scrape storm
    from kvtestbed.bench.surface_http import run_surfaces

    _progress("config_files, config_env, bearer_auth")
    surface_rows, out["http_surfaces"] = run_surfaces(quick, seed + 21)
    rows += surface_rows
    out["completed"] = True
    return finish(out)


def finish(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` as printed: the rows and surfaces measured so far, and every check on the
    figures it holds (a stage a signal cut short is a failed check, never a quiet pass)."""
    rows: list[FuzzResult] = out.pop("_rows", [])
    counter = out.pop("_tracebacks", None)
    if counter is not None:
        out["tracebacks"] = {"count": counter.count, "first": counter.first}
    results: list[Any] = out.pop("_surfaces", [])
    floods = out.setdefault("floods", {})
    web = out.get("http_surfaces")
    names = {r.name for r in rows}
    checks: dict[str, bool] = {}
    if not out.get("completed"):
        checks["run completed (not stopped by a signal)"] = False
    checks["fuzz rows: nothing escaped, nothing lost"] = all(
        r.escaped == 0 and r.lost == 0 and r.survived == r.cases for r in rows
        if r.name not in CONFIG_ROWS)
    if web is not None:
        checks["config/auth rows: nothing escaped, nothing lost"] = all(
            r.escaped == 0 and r.lost == 0 for r in rows if r.name in CONFIG_ROWS)
        checks.update(web["checks"])
    if "labels" in floods:
        checks["label flood: < 100 series"] = floods["labels"]["series"] < 100
    if "http" in floods:
        checks["http flood: every idle connection closed by timeout"] = \
            floods["http"]["idle_closed"] == floods["http"]["idle"]
        checks["http flood: every concurrent scrape ok"] = \
            floods["http"]["scrapes_ok"] == floods["http"]["scrapers"]
    if "hook_latency" in floods:
        checks[HOOK_RATIO_CHECK] = floods["hook_latency"]["ratio"] <= 2.0
        out["hook_p99_ratio_within_2x"] = checks[HOOK_RATIO_CHECK]
    checks.update({f"surface {r.name}: ok": r.ok for r in results})
    checks["no traceback logged in any stage"] = out.get("tracebacks", {}).get("count", 0) == 0
    out.update({"ok": all(checks.values()) and bool(out.get("completed")),
                "completed": bool(out.get("completed")), "stages_done": sorted(names),
                "rows": [r.row() for r in rows], "surfaces": [r.row() for r in results],
                "checks": checks,
                "seconds": time.perf_counter() - out.pop("started", time.perf_counter())})
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"{'target':<18}{'cases':>9}{'survived':>10}{'escaped':>9}{'lost':>6}  tried")
    for r in out["rows"]:
        print(f"{r['name']:<18}{r['cases']:>9}{r['survived']:>10}{r['escaped']:>9}"
              f"{r['lost']:>6}  {r['tried']}")
    floods = out["floods"]
    if "hook_latency" in floods:
        h = floods["hook_latency"]
        print(f"\nhook flood ({h['calls']} calls: {h['inputs']} inputs a side, hit of "
              f"{h['hit_tokens']} tokens): p99 over the inputs of each one's per-call cost "
              f"(best of {h['rounds']} interleaved {h['batch']}-call batches), clean "
              f"{h['clean_p99_us']:.1f} us, hostile {h['hostile_p99_us']:.1f} us "
              f"(ratio {h['ratio']:.2f}, target <= 2); unsampled {h['long_hit_tokens']}-token "
              f"hit p99 {h['long_hit_p99_us']:.1f} us (break 7: O(hit) cost left in "
              f"monitor.py)")
    if "labels" in floods:
        lab = floods["labels"]
        print(f"label flood: {lab['batches']} batches with new medium/group -> "
              f"{lab['series']} series, {lab['per_batch_ms']:.3f} ms/batch")
    if "http" in floods:
        web = floods["http"]
        print(f"http flood: {web['idle']} idle connections ({web['idle_closed']} closed by "
              f"timeout), {web['scrapes_ok']}/{web['scrapers']} concurrent scrapes ok, worst "
              f"{web['worst_scrape_s']:.2f} s, {web['rejected']} answered 503")
    print(f"\n{'surface':<18}{'cases':>9}{'answered':>10}{'escaped':>9}{'lost':>6}"
          f"{'hangs':>7}{'tracebacks':>12}{'rss+MB':>8}  tried")
    for r in out["surfaces"]:
        print(f"{r['name']:<18}{r['cases']:>9}{r['answered']:>10}{r['escaped']:>9}"
              f"{r['lost']:>6}{r['hangs']:>7}{r['tracebacks']:>12}{r['rss_growth_mb']:>8.0f}"
              f"  {r['tried']}")
        if r["failed_checks"]:
            print(f"{'':<18}failed: {'; '.join(r['failed_checks'])}")
    from kvtestbed.bench.surface_http import print_surfaces

    if "http_surfaces" in out:
        print_surfaces(out["http_surfaces"])
    tb = out.get("tracebacks", {})
    print(f"\ntracebacks logged by the sidecar in all stages: {tb.get('count', 0)}"
          + (f" (first: {tb['first']})" if tb.get("first") else ""))
    if not out["completed"]:
        print(f"\nSTOPPED by a signal: only {', '.join(out['stages_done']) or 'nothing'} "
              "finished")
    failed = [name for name, good in out["checks"].items() if not good]
    print("\nOK: every check holds (nothing escaped, lost, hung or traced back)"
          if out["ok"] else f"\nFAILED: {'; '.join(failed)}")
    print(f"({out['seconds']:.1f} s)")


def run(args: argparse.Namespace) -> int:
    """The bench; on SIGTERM or Ctrl-C it prints what it measured, leaves no child process
    and exits 128 + the signal (:mod:`kvtestbed.bench.interrupt`)."""
    from kvtestbed.bench.interrupt import kill_descendants, note, stoppable

    # The fuzz makes the sidecar log what it skips (rate-limited); keep the table readable.
    logging.getLogger("sidecar").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    printed = threading.Lock()

    def report(final: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(final, indent=1))
        else:
            print_table(final)
        sys.stdout.flush()

    def on_deadline(state: Any) -> None:  # the stage did not unwind: end it from here
        if not printed.acquire(blocking=False):
            return
        note(f"signal {state.signum}: the running stage did not stop in time, ending it")
        report(finish(out))
        kill_descendants()
        os._exit(state.exit_code)

    with stoppable(on_deadline) as state:
        try:
            run_all(bool(args.quick), int(args.seed), out)
        except KeyboardInterrupt:
            note(f"stopped by signal {state.signum or signal.SIGINT}; reporting what was "
                 "measured")
            finish(out)
        if not printed.acquire(blocking=False):
            time.sleep(3600)  # the watchdog is printing and exiting
        report(out)
        if not out["completed"]:
            kill_descendants()
            exit_now(state.exit_code)
    exit_now(0 if out["ok"] else 1)
