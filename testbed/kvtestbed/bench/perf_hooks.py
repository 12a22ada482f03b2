"""Hot-path figures of ``kv-sidecar bench perf``: what each engine hook costs, side by side
with a no-op method call taking the same arguments, plus instruction counts and memory.

Every hook is timed over the same pre-built argument list as its no-op twin, in the same
process, repeatedly; the figure is the median ns per call and the spread is min..max over
the repeats. Instruction counts come from ``valgrind --tool=callgrind`` in a child process:
the child calls ``os.getppid()`` between phases and callgrind dumps its counters before each
such call (``--dump-before=os_getppid``), so each phase's count is exact and repeatable
under load, with interpreter start-up and imports excluded.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import (
    BlockKV,
    BlockRef,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
    Lookup,
    StoredBlock,
)

BLOCK_SIZE = 16
HIT_BLOCKS = 128  # a 2k-token prompt served from the cache
NUM_BLOCKS = 4096


class SyntheticAdapter:
    """A paged pool of random KV that answers every adapter call from memory: the cost
    measured is the sidecar's, not an engine's. ``recompute`` returns the cached bytes."""

    def __init__(self, layers: int = 2, heads: int = 2, head_dim: int = 32,
                 num_blocks: int = NUM_BLOCKS) -> None:
        g = torch.Generator().manual_seed(0)
        shape = (num_blocks, layers, heads, BLOCK_SIZE, head_dim)
        self.keys = torch.randn(shape, generator=g)
        self.values = torch.randn(shape, generator=g)
        self.info = EngineInfo(
            engine="bench", model="synthetic", revision="0", dtype="float32",
            block_size=BLOCK_SIZE, num_kv_heads=heads, head_dim=head_dim,
            groups=(CacheGroup(0, GroupKind.FULL_ATTENTION, tuple(range(layers)),
                               name="full"),))

    def describe(self) -> EngineInfo:
        return self.info

    def _kv(self, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return [BlockKV(r, self.keys[r.block_id].clone(), self.values[r.block_id].clone())
                for r in refs]

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return self._kv(refs)

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return self._kv(refs)

    def allocator(self) -> None:
        return None

    # Capture at match time (Core v2): the served bytes, copied before the hook returns.
    def capture(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return self._kv(refs)


class NoopSink:
    """The baseline: the same method names and arguments, doing nothing."""

    def on_lookup(self, lookup: Lookup) -> None:
        pass

    def on_store(self, block: StoredBlock) -> None:
        pass

    def on_free(self, group_id: int, block_ids: Sequence[int]) -> None:
        pass

    def on_request_done(self, latency_seconds: float) -> None:
        pass

    def on_allocate(self, group_id: int, seq_id: Any, block_ids: Sequence[int],
                    generations: Sequence[int]) -> None:
        pass

    def on_release(self, group_id: int, seq_id: Any, block_ids: Sequence[int]) -> None:
        pass


def monitor_for(sample_every: int, queue_size: int = 64, **config: Any) -> Monitor:
    """A Monitor on the synthetic adapter with production defaults, the worker not started
    (hook cost only), and event-triggered allocator checks off (no allocator here). The start
    burst is off unless ``config`` sets it: it samples the first 1,000 hits 1 in 10, so an
    "unsampled" figure over a few thousand calls would count ~100 sampled ones (callgrind
    counted 33,400 instructions per unsampled hit with it, 4,794 without)."""
    config.setdefault("burst_hits", 0)
    cfg = SidecarConfig(sample_every=sample_every, queue_size=queue_size,
                        allocator_check_min_interval_s=-1.0, **config)
    return Monitor(SyntheticAdapter(), cfg)


def hit_lookup(i: int, blocks: int = HIT_BLOCKS) -> Lookup:
    n = blocks * BLOCK_SIZE
    tokens = list(range(i, i + n + 7))
    ids = [(i + b) % NUM_BLOCKS for b in range(blocks)]
    hit = Hit(tokens=tokens, hit_tokens=n, blocks={0: ids}, generations={0: [1] * blocks})
    return Lookup(len(tokens), n, hit, seq_id=i)


def stored(i: int) -> StoredBlock:
    return StoredBlock(group_id=0, block_id=i % NUM_BLOCKS, generation=i // NUM_BLOCKS + 1,
                       tokens=list(range(i, i + BLOCK_SIZE)), prefix_tokens=0,
                       key_fields={"adapter": ""}, seq_id=i)


@dataclass(frozen=True)
class HookCase:
    """One hook figure: the hook, its no-op twin, and the argument tuples both get."""

    name: str
    call: Callable[[Monitor | NoopSink], Callable[..., None]]
    args: Callable[[int], list[tuple[Any, ...]]]
    sample_every: int = 10**9  # never sampled, unless the case says so
    prepare: Callable[[Monitor, int], None] | None = None


def _engine_thread_only(mon: Monitor, n: int) -> None:
    """This figure is the engine thread's share: the journal's thread (which applies the
    events, and is woken when many wait) is not running here, so its pending events are
    applied before the loop and its wake-up threshold lifted for it. What the journal's
    thread costs the engine is in the engine-overhead figure."""
    mon.journal.drain()
    mon.journal.wake_at = mon.journal.max_pending = 2 * n + 1


def _prestore(mon: Monitor, n: int) -> None:
    for i in range(n):
        mon.on_store(stored(i))


def _hits(n: int) -> list[tuple[Lookup]]:
    """``n`` hit lookups cycling through 64 of them: an engine calls the hook on a lookup it
    has just built, so its objects are in the cache. 50,000 distinct ones (2,048 token ints
    each, over a GB) made every call a cold read: ~500 ns more per unsampled hit, for the
    Monitor (793 vs 272 ns) and the front alike, none of it the hook's."""
    base = [hit_lookup(i) for i in range(64)]
    return [(base[i % 64],) for i in range(n)]


CASES: tuple[HookCase, ...] = (
    HookCase("on_lookup (hit, unsampled)", lambda s: s.on_lookup, lambda n: _hits(n)),
    HookCase("on_lookup (hit, sampled)", lambda s: s.on_lookup, lambda n: _hits(n),
             sample_every=1),
    HookCase("on_lookup (miss)", lambda s: s.on_lookup,
             lambda n: [(Lookup(2048, 0),) for _ in range(n)]),
    HookCase("on_store", lambda s: s.on_store, lambda n: [(stored(i),) for i in range(n)]),
    HookCase("on_free", lambda s: s.on_free,
             lambda n: [(0, (i % NUM_BLOCKS,)) for i in range(n)], prepare=_prestore),
    HookCase("on_request_done", lambda s: s.on_request_done,
             lambda n: [(0.05 + (i % 7) * 0.01,) for i in range(n)]),
    # What the reference engine sends per request: the sequence's fresh blocks (8 here).
    HookCase("on_allocate", lambda s: s.on_allocate,
             lambda n: [(0, i, tuple((i + b) % NUM_BLOCKS for b in range(8)), (1,) * 8)
                        for i in range(n)]),
    HookCase("on_release", lambda s: s.on_release,
             lambda n: [(0, i, tuple((i + b) % NUM_BLOCKS for b in range(8)))
                        for i in range(n)]),
)

# Each of these hooks appends to the cache-event journal; applying it later is work the
# engine's process pays too (sidecar.core.journal), so their figure is hook + apply.
JOURNALED = ("on_store", "on_free", "on_allocate", "on_release")


def _loop(fn: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> int:
    t0 = time.perf_counter_ns()
    for a in args:
        fn(*a)
    return time.perf_counter_ns() - t0


def time_case(case: HookCase, n: int, repeats: int) -> dict[str, Any]:
    """ns per call of the hook and of its no-op twin, interleaved per repeat; for journaled
    hooks also the ns per event of applying the journal afterwards (``apply_ns``: the
    same process pays it, on the journal's thread or whoever drains first)."""
    args = case.args(n)
    hook_ns: list[float] = []
    noop_ns: list[float] = []
    apply_ns: list[float] = []
    noop = NoopSink()
    for _ in range(repeats):
        mon = monitor_for(case.sample_every, queue_size=n + 1)
        if case.prepare is not None:
            case.prepare(mon, n)
        _engine_thread_only(mon, n)
        gc.collect()
        noop_ns.append(_loop(case.call(noop), args) / n)
        hook_ns.append(_loop(case.call(mon), args) / n)
        t0 = time.perf_counter_ns()
        mon.journal.drain()
        apply_ns.append((time.perf_counter_ns() - t0) / n)
        mon.stop()
    return {"hook_ns": hook_ns, "noop_ns": noop_ns, "apply_ns": apply_ns,
            "total_ns": [h + a for h, a in zip(hook_ns, apply_ns, strict=True)]}


class _DiscardExporter:
    """An OpenTelemetry exporter that drops what it is handed (the export's cost stays)."""

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kw: Any) -> Any:
        from opentelemetry.sdk.metrics.export import MetricExportResult

        return MetricExportResult.SUCCESS

    def shutdown(self, timeout_millis: float = 30_000, **kw: Any) -> None:
        return None


def time_otel(n: int, repeats: int) -> dict[str, Any]:
    """Unsampled on_lookup with OpenTelemetry push running (every 50 ms, on its own thread)
    vs without, interleaved per repeat."""
    from sidecar.export.otel import OtelExporter

    case = CASES[0]
    args = case.args(n)
    on_ns: list[float] = []
    off_ns: list[float] = []
    for _ in range(repeats):
        mon = monitor_for(case.sample_every, queue_size=n + 1)
        gc.collect()
        off_ns.append(_loop(case.call(mon), args) / n)
        otel = OtelExporter(mon.metrics.registry, _DiscardExporter(),  # type: ignore[arg-type]
                            interval_s=0.05).start()
        on_ns.append(_loop(case.call(mon), args) / n)
        otel.shutdown()
        mon.stop()
    return {"otel_on_ns": on_ns, "otel_off_ns": off_ns}


def summarize(samples: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


# ---------------------------------------------------------------- instruction counts
_CHILD = "kvtestbed.bench.perf_hooks"


def _child_main(n: int) -> None:
    """Run under callgrind: a marker (``os.getppid``) before each phase."""
    noop = NoopSink()
    plan = []
    for case in CASES:
        mon = monitor_for(case.sample_every, queue_size=n + 1)
        if case.prepare is not None:
            case.prepare(mon, n)
        _engine_thread_only(mon, n)
        plan.append((case, mon, case.args(n)))
    for case, mon, args in plan:
        gc.collect()
        os.getppid()  # dump: set-up (or the previous case's gc)
        _loop(case.call(mon), args)
        os.getppid()  # dump: the hook phase
        mon.journal.drain()
        os.getppid()  # dump: the journal apply phase (empty for hooks that journal nothing)
        _loop(case.call(noop), args)
        os.getppid()  # dump: the no-op phase


def instruction_counts(n: int = 2000, timeout_s: float = 600.0) -> dict[str, Any]:
    """Instructions per call of each hook and of its no-op twin, or why they are missing."""
    totals = callgrind_phases(_CHILD, ["--child", str(n)], timeout_s)
    if isinstance(totals, str):
        return {"error": totals}
    # Per case four dumps: set-up/gc before it, the hook, the journal apply, the no-op.
    if len(totals) < 4 * len(CASES):
        return {"error": f"expected {4 * len(CASES)} callgrind dumps, got {len(totals)}"}
    out_cases = {}
    for i, case in enumerate(CASES):
        hook, apply, noop = totals[4 * i + 1], totals[4 * i + 2], totals[4 * i + 3]
        out_cases[case.name] = {"hook": hook / n, "apply": apply / n,
                                "total": (hook + apply) / n, "noop": noop / n}
    return {"calls_per_phase": n, "cases": out_cases}


def callgrind_phases(module: str, args: list[str], timeout_s: float) -> list[int] | str:
    """Run ``python -m module *args`` under callgrind, which dumps its counters before each
    ``os.getppid()`` the child calls: the instructions of each phase between two markers,
    in order; or why there are none (valgrind missing, the child failed or ran too long)."""
    if shutil.which("valgrind") is None:
        return "valgrind not installed (apt-get install valgrind)"
    with tempfile.TemporaryDirectory(prefix="kvsidecar-cg-") as tmp:
        out = Path(tmp) / "cg.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               "--dump-before=os_getppid", sys.executable, "-m", module, *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"callgrind ran past {timeout_s:g}s"
        if proc.returncode != 0:
            return f"callgrind child failed: {proc.stderr.strip()[-300:]}"
        dumps = sorted(Path(tmp).glob("cg.out.*"), key=lambda p: int(p.suffix[1:]))
        return [callgrind_total(p) for p in dumps]


def callgrind_total(path: Path) -> int:
    """The instruction total of one callgrind dump file (0 if it has none)."""
    for line in path.read_text(errors="replace").splitlines():
        m = re.match(r"(?:summary|totals):\s*(\d+)", line)
        if m:
            return int(m.group(1))
    return 0


# ---------------------------------------------------------------- memory
def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _memory_child(checkpoints: Sequence[int]) -> dict[str, int]:
    """Balanced stores/frees with a hit per store (each sampled 1 in 1000) through one
    Monitor; RSS at each checkpoint. Stored blocks live in a ring of NUM_BLOCKS."""
    mon = monitor_for(1000, queue_size=64)
    lookups = [hit_lookup(i, blocks=8) for i in range(64)]
    out: dict[str, int] = {}
    events = 0
    i = 0
    targets = list(checkpoints)
    while targets:
        b = stored(i)
        mon.on_store(b)
        mon.on_lookup(lookups[i % 64])
        if i >= NUM_BLOCKS // 2:
            mon.on_free(0, ((i - NUM_BLOCKS // 2) % NUM_BLOCKS,))
            events += 1
        events += 2
        i += 1
        if events >= targets[0]:
            gc.collect()
            out[str(targets.pop(0))] = rss_bytes()
    mon.stop()
    return out


def memory_profile(checkpoints: Sequence[int] = (100_000, 1_000_000),
                   timeout_s: float = 600.0) -> dict[str, Any]:
    """RSS after each checkpoint of events, in a fresh process (nothing else resident)."""
    cmd = [sys.executable, "-m", _CHILD, "--memory", ",".join(map(str, checkpoints))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-300:]}
    return {"rss_bytes": json.loads(proc.stdout.strip().splitlines()[-1])}


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        _child_main(int(sys.argv[2]))
    elif sys.argv[1] == "--memory":
        print(json.dumps(_memory_child([int(x) for x in sys.argv[2].split(",")])))
