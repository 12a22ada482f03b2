"""``dispatch = "process"``: what the engine's process pays per event through the front
(:mod:`sidecar.adapters.remote.front`), for ``kv-sidecar bench perf``'s ``process`` figure.

Per hook case of :mod:`.perf_hooks` (the same arguments): the hook's ns per call on the
engine's thread, then the shipping (the shipper's drain every :data:`SHIP_BATCH` events:
runs built, msgpack, ZMQ send) ns per event, and the engine process's CPU for both
together (``process_time``: every
thread of this process, ZMQ's I/O thread included). The events go to a PULL socket in a
process of its own that only drains them, so no receiving cost lands here; the sidecar
process's work (journal apply, checks) is not the engine's process's and is not in these
figures (``bench perf``'s engine figure reports the sidecar process's CPU apart).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import tempfile
import time
import uuid
from typing import Any

from kvtestbed.bench.perf_hooks import CASES, SyntheticAdapter, summarize
from kvtestbed.bench.perf_row import Row
from sidecar.adapters.remote.front import EngineFront
from sidecar.adapters.remote.outbox import OUTBOX_LIMIT
from sidecar.core.monitor import SidecarConfig

# The cases the front can be timed on without a sampled capture (the capture is the same
# copy an in-process Monitor makes: bench perf's hooks figure has it).
FRONT_CASES = tuple(c for c in CASES if c.sample_every != 1)
# Events between two drains here: about what the shipper finds every 10 ms at ~100k events
# a second. Without drains the outbox's tuples outlive the young generations and the
# collector's full passes over the arguments (each hit holds 2,048 tokens) dominate.
SHIP_BATCH = 1024


def _drain(endpoint: str, ready: Any, stop: Any) -> None:
    """A PULL socket that receives and discards until ``stop`` is set."""
    import zmq

    sock: zmq.Socket = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(endpoint)
    ready.set()
    while not stop.is_set():
        if sock.poll(50):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
    sock.close(0)


def front_costs(n: int, repeats: int) -> dict[str, Any]:
    """Per case: ``hook_ns``, ``ship_ns`` and ``process_ns`` per event (module docstring),
    each as median/min/max over ``repeats``; ``n`` events per repeat (at most the outbox's
    bound, so nothing is dropped)."""
    n = min(n, OUTBOX_LIMIT)
    ctx = multiprocessing.get_context("spawn")
    endpoint = f"ipc://{tempfile.gettempdir()}/kvsidecar-bench-{uuid.uuid4().hex[:8]}.sock"
    ready, stop = ctx.Event(), ctx.Event()
    drain = ctx.Process(target=_drain, args=(endpoint, ready, stop), daemon=True)
    drain.start()
    try:
        if not ready.wait(60):
            return {"error": "the draining process did not start"}
        out: dict[str, Any] = {}
        for case in FRONT_CASES:
            args = case.args(n)
            hook, ship, proc = [], [], []
            for _ in range(repeats):
                front = EngineFront(SyntheticAdapter(), SyntheticAdapter().info,
                                    SidecarConfig(sample_every=case.sample_every,
                                                  burst_hits=0),
                                    endpoint, pipe_hwm=1 << 20)
                fn = case.call(front)  # type: ignore[arg-type]
                gc.collect()
                p0 = time.process_time()
                hook_ns = ship_ns = 0
                for at in range(0, n, SHIP_BATCH):  # the shipper drains as it runs
                    t0 = time.perf_counter_ns()
                    for a in args[at:at + SHIP_BATCH]:
                        fn(*a)
                    t1 = time.perf_counter_ns()
                    front.ship()
                    hook_ns += t1 - t0
                    ship_ns += time.perf_counter_ns() - t1
                time.sleep(0.2)  # ZMQ's I/O thread finishes the sends: its CPU counts too
                proc.append((time.process_time() - p0) * 1e9 / n)
                hook.append(hook_ns / n)
                ship.append(ship_ns / n)
                lost = front.pipe.lost_messages + front.pipe.lost_lookups
                front.stop()
                if lost:
                    return {"error": f"{case.name}: {lost} messages lost on the way"}
            out[case.name] = {"calls": n, "hook_ns": summarize(hook),
                              "ship_ns": summarize(ship), "process_ns": summarize(proc)}
        return out
    finally:
        stop.set()
        drain.join(10)
        if drain.is_alive():
            drain.kill()
        with contextlib.suppress(OSError):
            os.unlink(endpoint.removeprefix("ipc://"))


def process_rows(quick: bool, repeats: int, raw: dict[str, Any],
                 targets_ns: dict[str, float]) -> list[Row]:
    """The ``process`` figure: per-event cost in the engine's process through the front,
    against the in-process targets; and the unsampled hook's tail while the sidecar
    process verifies vs idle (target: within 2x)."""
    from kvtestbed.bench import perf_engine as E

    res = front_costs(2000 if quick else 50_000, 1 if quick else repeats)
    raw["process_events"] = res
    rows: list[Row] = []
    if "error" in res:
        return [Row(f"dispatch=process per event: skipped ({res['error'][:80]})",
                    float("nan"), float("nan"), "ns", float("nan"), "-", None)]
    for name, c in res.items():
        p, h = c["process_ns"], c["hook_ns"]
        target = targets_ns.get(name, 500.0 if name.startswith("on_lookup") else None)
        rows.append(Row(f"{name}, dispatch=process: engine process ns/event (hook + ship), "
                        "vs the hook alone", p["median"], h["median"], "ns",
                        p["median"] / h["median"], f"<= {target:g} ns" if target else "-",
                        p["median"] <= target if target else None,
                        f"{p['min']:.3g}..{p['max']:.3g}"))
    tail = E.hook_tail_latency(24 if quick else 200, 1 if quick else max(1, min(repeats, 3)),
                               dispatch="process")
    raw["process_tail"] = tail
    b, i = tail["busy_unsampled"], tail["idle"]
    ratio = b["p99_ns"] / i["p99_ns"] if i["p99_ns"] else float("nan")
    rows.append(Row("on_lookup p99, unsampled, dispatch=process: sidecar verifying vs idle",
                    b["p99_ns"], i["p99_ns"], "ns", ratio, "<= 2", ratio <= 2,
                    f"{b['p99_ns_spread'][0]:.3g}..{b['p99_ns_spread'][1]:.3g}"))
    return rows
