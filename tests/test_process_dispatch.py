"""``dispatch = "process"`` (sidecar.adapters.remote): the Monitor in a sidecar process of its own,
the engine's process holding only the front. Real processes (spawned), a real ZMQ pipe,
the reference engine and its recompute rebuilt in the sidecar process."""

from __future__ import annotations

import dataclasses
import math
import os
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.demo import DemoOptions, build_process, run_demo, sidecar_config
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from prometheus_client.parser import text_string_to_metric_families

from sidecar.adapters.remote import messages as C
from sidecar.adapters.remote.process import SidecarProcess, SidecarProcessError
from sidecar.adapters.vllm.wire import WireError, capture_fields, decode_capture, pack, unpack
from sidecar.core.dispatch import Dispatcher
from sidecar.core.protocol import BlockTableSnapshot, Lookup, StoredBlock

REQUESTS = 160


def _opts(fault: str, dispatch: str, model: str = "reference") -> DemoOptions:
    return DemoOptions(fault=fault, model=model, requests=REQUESTS, progress=False, port=0,
                       sidecar={"dispatch": dispatch})


def _metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.mark.parametrize(("model", "fault"), [
    ("reference", "none"), ("reference", "stale-reuse"), ("hybrid", "window-mismatch"),
    ("recurrent", "stale-recurrent-state")])
def test_same_verdicts_as_in_process(model: str, fault: str) -> None:
    """The front samples with the Monitor's sampler and seed, so the sidecar process
    verifies the same hits and reaches the same verdicts as an in-process Monitor (the
    hybrid engines' recurrent states and sliding windows included: their recompute is
    rebuilt in the sidecar process too)."""
    inproc = run_demo(_opts(fault, "queued", model))
    remote = run_demo(_opts(fault, "process", model))
    assert remote["dispatch"] == "process"
    for key in ("requests", "hits", "sampled", "verified", "anomalies"):
        assert remote[key] == inproc[key], key
    assert remote["verified"] > 50
    if fault == "none":
        assert not remote["anomalies"] and not remote["invariant_violations"]
    else:
        assert remote["anomalies"]


def test_allocator_faults_caught_from_the_census() -> None:
    """Invariants are checked on the census the front ships, one taken soon after each
    release as the Monitor's nudged poll is (an outside check found 4-14 censuses a run
    where in-process checks ran 68-216 times, and no free_while_held at all)."""
    s = run_demo(_opts("premature-free", "process"))
    assert s["invariant_violations"].get("free_while_held", 0) > 10
    leak = run_demo(_opts("leak", "process"))
    assert leak["leak_suspected"] and leak["first_leak_suspected_request"] < REQUESTS // 2


def _engine(fault: str = "none") -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model=ModelConfig(seed=0), num_blocks=256,
                                        fault=fault, kv_digest=True))


def _drive(engine: ReferenceEngine, requests: int) -> None:
    wl = ChatWorkload(WorkloadConfig(seed=0, conversations=requests // 3 + 8,
                                     block_size=engine.block_size))
    drive(engine, wl, max_requests=requests)


def test_hostile_hook_input_is_refused_and_counted_in_the_sidecar() -> None:
    """Bad input never raises out of a front hook; the front's refusals reach the sidecar's
    counters, and a value msgpack cannot hold (numpy ints, an int past 64 bits) costs only
    its own item or message, counted, not the events around it."""
    engine = _engine()
    sidecar = SidecarProcess(ReferenceAdapter(engine), dataclasses.replace(
        sidecar_config(_opts("none", "process")), sample_every=2), port=0).start()
    try:
        f = sidecar.front
        assert f.on_lookup(None) is None  # type: ignore[func-returns-value,arg-type]
        f.on_lookup(Lookup(5, 9))  # hit > query
        f.on_store("block")  # type: ignore[arg-type]
        f.on_free(-1, [1])
        f.on_request_done(math.nan)
        f.on_allocate(0, 7, np.array([1, 2]), ())  # type: ignore[arg-type]
        # past the front's O(1) door checks, refused by the sidecar's full ones:
        f.on_free(0, [np.int64(3)])  # type: ignore[list-item]
        f.on_store(StoredBlock(0, 2**70, 0, [1] * 16, 0))
        engine.sink = f
        _drive(engine, 60)
        assert sidecar.drain(60)  # the front's counts ride on the drain's mark: current now
        s = sidecar.summary()
        assert s["requests"] == 60 and s["verified"] > 0 and not s["anomalies"]
        url = sidecar.url
        assert url is not None
        rejected = "kvsidecar_hook_input_rejected_total"
        for hook in ("on_lookup", "on_store", "on_free", "on_request_done", "on_allocate"):
            assert _metric(url, rejected, hook=hook) >= 1, hook
        assert _metric(url, rejected, hook="on_lookup") >= 2
        assert _metric(url, rejected, hook="on_free") >= 2  # -1, then the numpy id
        assert _metric(url, rejected, hook="on_store") >= 2  # "block", then 2**70
        assert _metric(url, "kvsidecar_probe_lost_total") == 0  # nothing else lost
    finally:
        sidecar.stop()


def test_a_dead_sidecar_process_never_harms_the_engine() -> None:
    """Killed mid-run: the engine's hooks go on returning (the pipe drops and counts),
    the owner gets a clear error, and stop() returns."""
    engine = _engine()
    sidecar = SidecarProcess(ReferenceAdapter(engine),
                             sidecar_config(_opts("none", "process"))).start()
    engine.sink = sidecar.front
    try:
        _drive(engine, 20)
        sidecar.process.kill()
        sidecar.process.join(10)
        t0 = time.perf_counter()
        _drive(engine, 60)
        assert time.perf_counter() - t0 < 120  # it ran: no hook waited for the sidecar
        assert not engine.sink_errors
        with pytest.raises(SidecarProcessError, match="not running"):
            sidecar.summary()
    finally:
        sidecar.stop(timeout_s=5)
    assert not sidecar.process.is_alive()


def test_only_the_front_is_heard_and_the_lifecycle_is_safe(tmp_path: Any) -> None:
    """Another process of the same user on the socket is refused (an outside check minted
    stores that raised false token mismatches, and 12M lookups); a used endpoint is
    refused; start/stop in any order give clear answers; the socket file goes with stop."""
    import zmq

    from sidecar.adapters.vllm.wire import pack as wire_pack

    engine = _engine()
    sidecar = SidecarProcess(ReferenceAdapter(engine), dataclasses.replace(
        sidecar_config(_opts("none", "process")), sample_every=2), port=0)
    sidecar.stop()  # before start: nothing to stop, and it can still start
    sidecar.start()
    path = sidecar.endpoint.removeprefix("ipc://")
    try:
        assert sidecar.start() is sidecar  # running: idempotent
        with pytest.raises(SidecarProcessError, match="in use"):
            SidecarProcess(ReferenceAdapter(engine), endpoint=sidecar.endpoint)
        engine.sink = sidecar.front
        _drive(engine, 40)
        liar = zmq.Context.instance().socket(zmq.PUSH)
        liar.connect(sidecar.endpoint)
        forged = [[0, b, 1, [7] * 16, 0, None, None, None, None, None, "prefill"]
                  for b in range(64)]
        for src in ("forged", sidecar.front.pipe.src[:-1] + "x"):
            liar.send(wire_pack("events", src, runs=[["block_stores", {"items": forged}],
                                                     ["lookups", {"items": [[9, 9]] * 5000}]]))
        time.sleep(1.0)
        liar.close(0)
        _drive(engine, 40)
        assert sidecar.drain(60)
        s = sidecar.summary()
        assert s["requests"] == 80 and not s["anomalies"] and not s["invariant_violations"]
        assert s["lookups"] == 80  # none of the 10,000 forged ones
        assert _metric(sidecar.url or "", "kvsidecar_hook_errors_total",
                       hook="probe_message") == 2
    finally:
        sidecar.stop()
        sidecar.stop()  # twice: a no-op
    assert not os.path.exists(path)
    with pytest.raises(SidecarProcessError, match="stopped"):
        sidecar.start()
    # a /metrics port that is taken: a clear error, and no socket left behind
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        failed = SidecarProcess(ReferenceAdapter(engine), port=taken.getsockname()[1])
        with pytest.raises(SidecarProcessError, match="failed to start"):
            failed.start()
    assert not os.path.exists(failed.endpoint.removeprefix("ipc://"))


def test_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="SidecarProcess"):
        Dispatcher(lambda s: None, lambda v: None, lambda r: None,  # type: ignore[arg-type,return-value]
                   mode="process")

    class NoReference(ReferenceAdapter):
        remote_reference = None  # type: ignore[assignment]

    with pytest.raises(SidecarProcessError, match="remote_reference"):
        SidecarProcess(NoReference(_engine()))
    with pytest.raises(ValueError, match="/metrics"):
        build_process(dataclasses.replace(_opts("none", "process"), otel="console"))


# ------------------------------------------------------------------ wire: no processes
def _capture(**extras: Any) -> dict[str, Any]:
    k = torch.zeros(2, 1, 4, 8)
    fields = capture_fields("c", "hit", None, list(range(8)), 8, 8, {0: [5, 6]},
                            [(0, 1, 6, k, k)])
    return unpack(pack("capture", **fields, **extras))


def test_capture_hit_extras_round_trip_and_bounds() -> None:
    cap = decode_capture(_capture(generations={0: [3, 4]}, tier_states={0: [None, "loaded"]},
                                  seq_id="r1", kv_generations=[[0, 1, 4]]))
    assert cap.generations == {0: (3, 4)} and cap.seq_id == "r1"
    assert cap.tier_states[0][0] is None and cap.tier_states[0][1].value == "loaded"
    assert cap.kv_generations == {(0, 1): 4}
    for bad in ({"generations": {0: [1, 2, 3]}},  # longer than the group's blocks
                {"generations": {1: [1]}},  # a group the capture does not name
                {"tier_states": {0: ["gone"]}},
                {"seq_id": ["x"]},
                {"kv_generations": [[0, 0, 1]]},  # a block not captured
                {"generations": {0: [-1]}}):
        with pytest.raises(WireError):
            decode_capture(_capture(**bad))


def test_census_round_trip_and_bounds() -> None:
    table = BlockTableSnapshot(
        group_id=0, num_blocks=4, free=(3,), cached=(2,), ref_counts=(1, 1, 0, 0),
        block_hashes=(b"\x01", b"\x02", b"\x03", None), index=((b"\x01", 0), (b"\x03", 2)),
        sequences={7: (0, 1), ("odd", 1): (1,)}, generations=(1, 1, 2, 0))
    raw = unpack(pack("census", **C.census_fields(None, [table], {"rejected": []})))
    (back,) = C.decode_tables(raw["tables"]) or ()
    assert back.free == (3,) and back.block_hashes == table.block_hashes
    assert back.index == table.index and back.sequences[7] == (0, 1)
    assert "repr:('odd', 1)" in back.sequences  # a foreign id, by its repr
    assert C.decode_state(raw.get("state")) is None
    for bad in ([{"num_blocks": -1}], "tables", [{**raw["tables"][0], "free": ["x"]}],
                [{**raw["tables"][0], "index": [[1]]}]):
        with pytest.raises(WireError):
            C.decode_tables(bad)
    with pytest.raises(WireError):
        C.decode_state({"free_blocks": 1, "bogus": 2})
    with pytest.raises(WireError):
        C.decode_counts({"rejected": [["on_lookup", "type", -1]]})


# ------------------------------------------------------------------ the front alone
def _front(tmp_path: Any, **config: Any) -> tuple[Any, Any]:
    """A front on the reference engine, its pipe into a PULL socket here (no shipper
    thread: ``ship()`` is called by the test)."""
    import zmq

    from sidecar.adapters.remote.front import EngineFront
    from sidecar.core.monitor import SidecarConfig

    endpoint = f"ipc://{tmp_path}/front.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(endpoint)
    adapter = ReferenceAdapter(_engine())
    front = EngineFront(adapter, adapter.describe(), SidecarConfig(burst_hits=0, **config),
                        endpoint)
    return front, pull


def _received(pull: Any) -> list[dict[str, Any]]:
    import zmq

    out = []
    while pull.poll(500):
        out.append(unpack(pull.recv(zmq.NOBLOCK)))
    return out


def test_front_bounds_the_captures_waiting_for_the_shipper(tmp_path: Any) -> None:
    from sidecar.core.protocol import Hit

    front, pull = _front(tmp_path, sample_every=1, queue_size=2)
    engine = front.adapter.engine
    tokens = list(range(64))
    _drive(engine, 12)  # blocks to capture
    ids = list(range(4))
    for _ in range(5):
        front.on_lookup(Lookup(64, 64, Hit(tokens, 64, {0: ids})))
    assert front.dropped["queue_full"] == 3  # two captures wait, the rest counted
    assert front.ship() == 5
    kinds = [m["kind"] for m in _received(pull)]
    assert kinds.count("capture") == 2
    front.pipe.close()
    pull.close(0)


def test_a_store_whose_key_fields_cannot_be_read_costs_only_itself(tmp_path: Any) -> None:
    class Odd:  # a mapping-like object dict() cannot read
        def __bool__(self) -> bool:
            return True

    front, pull = _front(tmp_path, sample_every=10**6)
    front.on_lookup(Lookup(32, 0))
    front.on_store(StoredBlock(0, 1, 0, [1] * 16, 0, key_fields=Odd()))  # type: ignore[arg-type]
    front.on_free(0, [1])
    assert front.ship() == 2  # refused at the hook, counted there
    runs = [r for m in _received(pull) for r in m.get("runs", [])]
    assert [r[0] for r in runs] == ["lookups", "block_frees"]
    assert front.rejected[("on_store", "type")] == 1 and front.hook_errors["on_store"] == 0
    front.pipe.close()
    pull.close(0)


def test_the_front_ships_the_key_fields_a_store_had_when_it_was_called(
        tmp_path: Any) -> None:
    """The engine may change its mapping once the hook returns (outside check: in-process,
    that gave false key-field anomalies); the shipper packs later, so the front copies."""
    front, pull = _front(tmp_path, sample_every=10**6)
    fields = {"adapter": "a"}
    front.on_store(StoredBlock(0, 1, 0, [1] * 16, 0, key_fields=fields))
    fields["adapter"] = "CHANGED"
    assert front.ship() == 1
    (run,) = [r for m in _received(pull) for r in m.get("runs", [])]
    assert run[0] == "block_stores" and run[1]["items"][0][5] == {"adapter": "a"}
    front.pipe.close()
    pull.close(0)


def test_a_sampled_hit_the_front_cannot_take_is_still_a_lookup(tmp_path: Any) -> None:
    """Ids no pool has (-1, past 64 bits) are refused for the reasons an in-process Monitor
    gives; a hit past what one capture message holds is a capture_too_large drop (an
    outside check saw 1,000,001-token hits vanish, uncounted); each lookup still counts."""
    from sidecar.adapters.vllm.wire import MAX_ITEMS
    from sidecar.core.protocol import Hit

    front, pull = _front(tmp_path, sample_every=1)
    big = list(range(MAX_ITEMS + 16))
    for hit in (Hit(list(range(64)), 64, {0: [0, -1, 2, 3]}),
                Hit(list(range(64)), 64, {0: [0, 2**70, 2, 3]}),
                Hit(big, len(big), {0: list(range(len(big) // 16))})):
        front.on_lookup(Lookup(len(hit.tokens), hit.hit_tokens, hit))
    # a prompt past the cap whose hit is not: sent with the tokens the checks read
    front.on_lookup(Lookup(len(big), 64, Hit(big, 64, {0: [0, 1, 2, 3]})))
    assert sum(front.rejected.values()) == 2
    assert front.dropped["capture_too_large"] == 1 and not front.hook_errors
    assert front.ship() == 4
    got = _received(pull)
    lookups = [i for m in got for k, f in m.get("runs", []) if k == "lookups"
               for i in f["items"]]
    assert len(lookups) == 3
    (capture,) = [m for m in got if m["kind"] == "capture"]
    assert capture["hit_tokens"] == 64 and len(capture["tokens"]) == 64
    front.pipe.close()
    pull.close(0)


def test_an_engine_that_exits_without_stop_leaves_no_socket(tmp_path: Any) -> None:
    """Stopped at the interpreter's exit (an outside check found socket files left in /tmp
    after a normal exit or an uncaught exception, which then made the endpoint 'in use')."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(
        "import sys\n"
        "from kvtestbed.adapters.paged_adapter import ReferenceAdapter\n"
        "from kvtestbed.engines.engine import EngineConfig, ReferenceEngine\n"
        "from sidecar.adapters.remote.process import SidecarProcess\n"
        "if __name__ == '__main__':\n"
        "    s = SidecarProcess(ReferenceAdapter(ReferenceEngine(EngineConfig()))).start()\n"
        "    print(s.endpoint, flush=True)\n"
        "    raise SystemExit(int(sys.argv[1]))\n")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(["testbed", os.environ.get("PYTHONPATH", "")])}
    for code in (0, 3):
        out = subprocess.run([sys.executable, str(script), str(code)], capture_output=True,
                             text=True, timeout=300, env=env)
        assert out.returncode == code, out.stderr[-2000:]
        path = out.stdout.strip().removeprefix("ipc://")
        assert path and not os.path.exists(path)
