"""Floods for ``kv-sidecar bench reliability``: hook latency under hostile input (side by
side with clean input), label values from the wire, idle connections and scraper storms.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from typing import Any


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def reference(sample_every: int = 1000, timeout_s: float = 0.2, **config: Any
              ) -> tuple[Any, Any]:
    from kvtestbed.adapters.paged_adapter import ReferenceAdapter
    from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
    from kvtestbed.engines.model import ModelConfig
    from sidecar.core.monitor import Monitor, SidecarConfig

    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype="float32", seed=0),
                                          num_blocks=128, kv_digest=True))
    adapter = ReferenceAdapter(engine)
    mon = Monitor(adapter, SidecarConfig(sample_every=sample_every, adapter_timeout_s=timeout_s,
                                         recompute_tokens_per_s=0,
                                         allocator_check_min_interval_s=-1, **config))
    engine.sink = mon
    return engine, mon


def good_lookup(engine: Any) -> Any:
    """A real hit from the reference engine (its Lookup, as the engine handed it over)."""
    from kvtestbed.engines.engine import Request
    from sidecar.core.protocol import Lookup

    seen: list[Any] = []
    sink, real = engine.sink, engine.sink.on_lookup
    def spy(lookup: Any) -> None:
        seen.append(lookup)
        real(lookup)

    sink.on_lookup = spy
    prompt = list(range(1, 65))
    engine.serve(Request(prompt, max_new_tokens=1))
    engine.serve(Request(prompt + [7], max_new_tokens=1))
    del sink.on_lookup
    hits = [lk for lk in seen if lk.hit is not None]
    return hits[-1] if hits else Lookup(64, 0)


# ---------------------------------------------------------------- floods
HOOK_INPUTS = 512  # distinct inputs per side of the hook flood
def hook_flood(n: int, seed: int = 0) -> dict[str, Any]:
    """p99 of one on_lookup call on the calling (engine) thread, clean vs hostile: over
    :data:`HOOK_INPUTS` inputs per side, each input's cost taken as its best of several
    rounds (``n`` calls per side set how many), clean and hostile interleaved input by input
    so machine noise hits both."""
    from dataclasses import replace

    from kvtestbed.bench.fuzz import hostile_hook_call

    engine, mon = reference(sample_every=1_000_000)
    good = good_lookup(engine)
    rng = random.Random(seed)
    hostile: list[Any] = []
    while len(hostile) < HOOK_INPUTS:
        hook, args = hostile_hook_call(rng, good)
        if hook == "on_lookup":
            hostile.append(args[0])
    # Clean inputs as an engine hands them over: a fresh lookup each (not one object hot in
    # the cache), and unsampled (1 in 1M): the common case the hostile ones are held to.
    clean = [replace(good, hit=replace(good.hit, tokens=list(good.hit.tokens)))
             for _ in range(HOOK_INPUTS)]
    # What a p99 means here: the cost an input recurs at, not when the OS preempted the
    # process mid-batch. On a shared 2-core machine (load ~12) the p99 of raw batch means
    # swung 0.67x-2.4x from run to run for the same code (median ratio a steady 1.13x): a
    # figure of the machine. So each input's cost is the best of ``rounds`` batches spread
    # over the run (a preemption hits a batch, not every round of it), and the p99 is over
    # the inputs: a hostile input that is expensive every time still shows, at full cost.
    import gc

    batch = 10
    rounds = max(5, n // (HOOK_INPUTS * batch))
    clock = time.perf_counter
    best_clean = [float("inf")] * HOOK_INPUTS
    best_bad = [float("inf")] * HOOK_INPUTS
    order = list(range(HOOK_INPUTS))
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            rng.shuffle(order)
            for i in order:
                lookup = clean[i]
                t = clock()
                for _ in range(batch):
                    mon.on_lookup(lookup)
                best_clean[i] = min(best_clean[i], (clock() - t) / batch)
                lookup = hostile[i]
                t = clock()
                for _ in range(batch):
                    mon.on_lookup(lookup)
                best_bad[i] = min(best_bad[i], (clock() - t) / batch)
    finally:
        if gc_was:
            gc.enable()
    clean_p99, bad = _p99(best_clean), _p99(best_bad)
    # Break 7, for the record: an unsampled 128k-token hit should cost what a short one
    # does. The Monitor's lifecycle log still walks the hit's blocks (owner: the Core v2
    # refactor of monitor.py), so this is reported, not asserted.
    from sidecar.core.protocol import Hit, Lookup

    long_tokens = 128 * 1024
    bs = mon.info.block_size
    long = Lookup(long_tokens, long_tokens, Hit(list(range(long_tokens)), long_tokens,
                                                {0: list(range(long_tokens // bs))},
                                                {0: [1] * (long_tokens // bs)}))
    long_t: list[float] = []
    for _ in range(max(50, n // 50)):
        t = clock()
        mon.on_lookup(long)
        long_t.append(clock() - t)
    return {"calls": 2 * HOOK_INPUTS * batch * rounds, "batch": batch, "rounds": rounds,
            "inputs": HOOK_INPUTS, "clean_p99_us": clean_p99 * 1e6,
            "hostile_p99_us": bad * 1e6, "ratio": bad / clean_p99 if clean_p99 else 0.0,
            "hit_tokens": good.hit_tokens,
            "long_hit_tokens": long_tokens, "long_hit_p99_us": _p99(long_t) * 1e6}


def label_flood(batches: int) -> dict[str, Any]:
    """Every batch names a new medium and group: the series count must stay bounded."""
    from sidecar.adapters.vllm.audit import EventAuditor
    from sidecar.adapters.vllm.events import decode_message, encode_batch
    from sidecar.export.metrics import Metrics

    m = Metrics("flood", "labels")
    a = EventAuditor(m, groups=[0])
    started = time.perf_counter()
    for j in range(batches):
        ev = {"type": "BlockStored", "block_hashes": [j + 1], "parent_block_hash": None,
              "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": f"m{j}",
              "group_idx": j, "lora_name": None}
        a.apply(decode_message(encode_batch(j, [0.0, [ev]])))
    per_batch = (time.perf_counter() - started) / max(batches, 1)
    series = sum(1 for fam in m.registry.collect() for s in fam.samples
                 if s.name.startswith("kvsidecar_kv_"))
    return {"batches": batches, "series": series, "per_batch_ms": per_batch * 1e3}


def http_flood(idle: int, scrapers: int) -> dict[str, Any]:
    """``idle`` connections that never send, then ``scrapers`` concurrent /metrics GETs."""
    import urllib.request

    from sidecar.export.server import SidecarServer

    _engine, mon = reference()

    srv = SidecarServer(mon.metrics.registry, mon.summary, port=0, timeout_s=1.0).start()
    conns = []
    try:
        for _ in range(idle):
            try:
                conns.append(socket.create_connection(("127.0.0.1", srv.port), timeout=2))
            except OSError:
                break
        ok, worst = [0], [0.0]
        lock = threading.Lock()

        def scrape() -> None:
            t = time.perf_counter()
            try:
                with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
                    good = r.status == 200
            except Exception:
                good = False
            with lock:
                ok[0] += good
                worst[0] = max(worst[0], time.perf_counter() - t)

        threads = [threading.Thread(target=scrape) for _ in range(scrapers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        time.sleep(1.5)  # idle connections time out
        closed = 0
        for c in conns:
            c.settimeout(0.5)
            with contextlib.suppress(OSError):
                closed += c.recv(1) == b""
        with urllib.request.urlopen(srv.url + "/healthz", timeout=5) as r:
            status_ok = r.status == 200  # still serving after the flood
        return {"idle": len(conns), "idle_closed": closed, "scrapers": scrapers,
                "scrapes_ok": ok[0], "worst_scrape_s": worst[0], "rejected": srv.rejected,
                "server_alive": status_ok}
    finally:
        for c in conns:
            c.close()
        srv.stop()
