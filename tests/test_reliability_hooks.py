"""Issue 12, breaks 3, 4, 6, 7 and 8: hook input, evidence durability, adapter faults and
the HTTP surface. Each test is a reproduction from the issue."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import pytest

from sidecar import signals as S
from sidecar.core.health import monitor_health
from sidecar.core.hook_input import check_lookup
from sidecar.core.protocol import BlockKV, BlockRef, Hit, Lookup
from sidecar.core.time_limits import AdapterRefused, AdapterTimeout, Guard
from sidecar.evidence.record import EvidenceLog
from sidecar.export.server import SidecarServer
from tests.conftest import make_toy

PROMPT = list(range(1, 17))  # 4 full blocks of 4


# ---------------------------------------------------------------- break 3: bad values
def test_none_latency_and_nan_lookup_do_not_poison_status(toy) -> None:
    engine, _, mon = toy
    mon.on_request_done(None)  # type: ignore[arg-type]
    mon.on_lookup(Lookup(float("nan"), 0))  # type: ignore[arg-type]
    mon.on_request_done(float("nan"))
    mon.on_request_done(0.25)
    engine.serve(PROMPT)
    s = mon.summary()  # raised TypeError until 10,000 more requests passed
    json.dumps(s, allow_nan=False)
    assert s["p99_latency_seconds"] == 0.25
    assert mon.metrics.value(S.QUERY_TOKENS.name) == 16
    assert mon.metrics.value(S.HOOK_INPUT_REJECTED.name, hook="on_lookup", reason="nan") == 1


def test_status_never_emits_nan_or_500() -> None:
    from prometheus_client import CollectorRegistry

    srv = SidecarServer(CollectorRegistry(), lambda: {"x": float("nan"), "y": [float("inf")]},
                        port=0).start()
    try:
        with urllib.request.urlopen(srv.url + "/status", timeout=5) as r:
            body = r.read().decode()
        assert json.loads(body, parse_constant=lambda c: pytest.fail(c)) == {"x": None,
                                                                              "y": [None]}
    finally:
        srv.stop()


# ---------------------------------------------------------------- break 7: O(1) hooks
class _NoIter(Sequence[int]):
    """A huge hit whose tokens/blocks must never be walked by the validator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        raise AssertionError("validator iterated the hit")


def test_validator_is_o1_and_absurd_hits_are_dropped_fast(toy) -> None:
    n = 400_000_000
    assert check_lookup(Lookup(128_000, 128_000, Hit(_NoIter(128_000), 128_000,
                                                     {0: _NoIter(8000)}))) is None
    _, _, mon = toy
    started = time.perf_counter()
    mon.on_lookup(Lookup(n, n, Hit(_NoIter(n), n, {0: range(n // 4)})))
    mon.on_lookup(Lookup(4e8, 4e8, None))  # type: ignore[arg-type]
    assert time.perf_counter() - started < 0.5  # was 4 s on the engine thread
    assert mon.metrics.value(S.HITS.name) == 0
    assert mon.metrics.value(S.HOOK_INPUT_REJECTED.name, hook="on_lookup", reason="absurd") == 1
    assert mon.metrics.value(S.HOOK_INPUT_REJECTED.name, hook="on_lookup", reason="type") == 1


# ---------------------------------------------------------------- break 4: evidence
def _rec(i: int, **extra: object) -> dict[str, object]:
    return {"kind": "test", "i": i, **extra}


def test_evidence_sequence_continues_across_restarts_and_stays_bounded(tmp_path) -> None:
    for run in range(3):
        log = EvidenceLog(capacity=100, directory=tmp_path)
        for i in range(70):
            log.add(_rec(i, run=run))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 100  # was 197 -> 229
    seqs = [json.loads((tmp_path / n).read_text())["seq"] for n in names]
    assert seqs == list(range(111, 211))  # nothing overwritten, oldest pruned first


def test_evidence_tmp_leftovers_are_settled_deterministically(tmp_path) -> None:
    log = EvidenceLog(capacity=10, directory=tmp_path)
    log.add(_rec(1))
    (tmp_path / "anomaly-00000002.json.tmp").write_text(json.dumps({"seq": 2, "ok": 1}))
    (tmp_path / "anomaly-00000003.json.tmp").write_text('{"seq": 3, "tru')  # killed mid-write
    log2 = EvidenceLog(capacity=10, directory=tmp_path)
    assert (log2.recovered, log2.discarded) == (1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anomaly-00000001.json",
                                                          "anomaly-00000002.json"]
    assert log2.add(_rec(3))["seq"] == 3


def test_evidence_files_private_fields_capped_secrets_hashed(tmp_path) -> None:
    from sidecar.checks.verifier import Sample, Verdict

    hit = Hit(PROMPT, 16, {0: [1, 2, 3, 4]},
              key_fields={"cache_salt": "s3cret-salt", "adapter": "k" * 5_000_000})
    log = EvidenceLog(capacity=5, directory=tmp_path, max_bytes=20_000)
    for _ in range(8):
        log.record(Verdict(Sample(hit, (BlockRef(0, 0, 1),), {}, 0.0)), "toy", "m")
    files = sorted(tmp_path.iterdir())
    assert 1 <= len(files) <= 5
    assert sum(f.stat().st_size for f in files) <= 20_000
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o600
        body = f.read_text()
        assert "s3cret-salt" not in body and "sha256:" in body
        assert len(body) < 10_000


# ---------------------------------------------------------------- break 6: adapter faults
@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()])
def test_base_exception_from_adapter_does_not_kill_the_verifier(exc) -> None:
    engine, adapter, mon = make_toy()
    adapter.fail["read"] = exc
    mon.start()
    try:
        engine.serve(PROMPT)
        engine.serve(PROMPT + [1])
        assert mon.drain(5)
        del adapter.fail["read"]
        engine.serve(PROMPT + [2])
        assert mon.drain(5)
        assert mon.dispatcher.alive
        assert mon.summary()["verified"] == 2
        assert monitor_health(mon)["ok"]
    finally:
        mon.stop()


def test_hung_allocator_does_not_get_reads_refused() -> None:
    g = Guard(0.05, max_stuck=2)
    release = threading.Event()
    for _ in range(4):
        with pytest.raises((AdapterTimeout, AdapterRefused)):  # allocator only
            g.call("allocator", release.wait, 30)
    assert g.call("read", lambda: "ok") == "ok"
    release.set()


def test_guard_reuses_a_worker_not_a_stuck_one_and_idle_ones_end(monkeypatch) -> None:
    from sidecar.core import time_limits

    monkeypatch.setattr(time_limits, "IDLE_S", 0.2)
    g = Guard(0.05)
    first = g.call("allocator", threading.current_thread)
    assert g.call("block_tables", threading.current_thread) is first  # reused, not new
    release = threading.Event()
    with pytest.raises(AdapterTimeout):
        g.call("read", release.wait, 30)  # first's worker, now stuck
    assert g.call("read", threading.current_thread) is not first  # stuck: not handed out
    release.set()
    first.join(10)  # the stuck call finishes, its worker idles, then ends
    assert not first.is_alive() and g.stuck == 0


def test_a_stopped_monitor_leaves_no_adapter_call_thread_behind(toy) -> None:
    """Guard.close(), from Monitor.stop(): the idle workers end now, not IDLE_S later (no
    thread of the sidecar's own outlives its stop); a later call starts a new one."""
    engine, _, mon = toy
    before = set(threading.enumerate())
    mon.start()
    engine.serve(list(range(100, 140)))
    engine.serve(list(range(100, 140)))
    assert mon.drain(30)
    workers = [t for t in set(threading.enumerate()) - before
               if t.name == "kvsidecar-adapter-call"]
    assert workers  # the poller's calls ran on reused workers
    workers.append(mon.guard.call("describe", threading.current_thread))  # the Monitor's own
    mon.stop()
    assert not [t for t in workers if t.is_alive()]
    g = Guard(1.0)
    first = g.call("x", threading.current_thread)
    g.close()
    assert not first.is_alive()
    assert g.call("x", threading.current_thread) is not first  # a new worker
    # A worker busy (here: stuck) when its Guard closes ends as its call returns, not
    # IDLE_S later (an outside check found four such threads living on after stop()).
    release = threading.Event()
    g2 = Guard(0.05)
    box: list[threading.Thread] = []
    with pytest.raises(AdapterTimeout):
        g2.call("read", lambda: (box.append(threading.current_thread()), release.wait(30)))
    g2.close()
    release.set()
    box[0].join(5)
    assert not box[0].is_alive()


def test_unasked_blocks_ignored_missing_blocks_dropped_samples_counted() -> None:
    engine, adapter, mon = make_toy()
    real_read = adapter.read

    def read(hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        blocks = real_read(hit, refs)
        rogue = BlockKV(BlockRef(99, 0, 7), blocks[0].key, blocks[0].value)
        return [rogue, *blocks[1:]]  # the first requested block never comes back

    adapter.read = read  # type: ignore[method-assign]
    engine.serve(PROMPT)
    verdict = mon.verify(engine.serve(PROMPT + [5]))
    assert all(r.group_id != 99 for r in verdict.verified)
    assert len(verdict.verified) == 1
    assert ("read", "unexpected_block") in verdict.adapter_errors
    assert verdict.dropped == {S.DropReason.ADAPTER_ERROR: 1}
    assert mon.metrics.value(S.VERIFIED.name, group="99") == 0


def test_drop_counter_counts_samples_not_blocks() -> None:
    engine, adapter, mon = make_toy(adapter_timeout_s=0.05, blocks_per_sample=2)
    adapter.hang["read"] = threading.Event()
    mon.start()
    try:
        engine.serve(PROMPT)
        for t in range(3):
            engine.serve(PROMPT + [t])
        assert mon.drain(10)
        dropped = mon.metrics.value(S.SAMPLES_DROPPED.name, reason="adapter_timeout")
        assert dropped == mon.metrics.value(S.SAMPLED.name) == 3
    finally:
        adapter.hang["read"].set()
        mon.stop()
    with pytest.raises(AdapterTimeout):
        Guard(0.01).call("read", time.sleep, 1)


# ---------------------------------------------------------------- break 8: HTTP
def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_idle_connections_hold_no_thread_time_out_and_handlers_are_bounded() -> None:
    from prometheus_client import CollectorRegistry

    srv = SidecarServer(CollectorRegistry(), dict, port=0, timeout_s=0.3,
                        max_handlers=1).start()
    try:
        assert srv.httpd.request_queue_size >= 128
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(50)]
        assert _get(srv.url + "/metrics")[0] == 200  # 50 idle connections, 1 handler: fine
        for s in idle:
            s.settimeout(3)
            assert s.recv(10) == b""  # closed by the server once idle past the timeout
        assert srv.idle_closed >= 50
        loris = socket.create_connection(("127.0.0.1", srv.port))
        loris.sendall(b"G")  # holds the only handler until its read times out
        time.sleep(0.1)
        late = socket.create_connection(("127.0.0.1", srv.port))
        late.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        late.settimeout(5)
        assert late.recv(12).startswith(b"HTTP/1.")  # served once free, or a 503: never hangs
        loris.settimeout(5)
        answer = loris.recv(100)  # timed out: closed (http.server may say 408/400 first)
        assert answer == b"" or answer.startswith(b"HTTP/1.")
        for s in (*idle, loris, late):
            s.close()
    finally:
        srv.stop()


def test_healthz_reports_a_dead_verifier() -> None:
    _, _, mon = make_toy()
    srv = SidecarServer(mon.metrics.registry, mon.summary, port=0,
                        health=lambda: monitor_health(mon)).start()
    try:
        assert _get(srv.url + "/healthz")[0] == 503  # verifier never started
        mon.start()
        code, body = _get(srv.url + "/healthz")
        assert code == 200 and body.startswith("ok\n")
        mon.stop()
        assert _get(srv.url + "/healthz")[0] == 503
    finally:
        srv.stop()


def test_opt_in_bearer_token_guards_status(tmp_path, monkeypatch) -> None:
    from sidecar.export.server import load_token

    path = tmp_path / "token"
    path.write_text("t0ken\n")
    os.chmod(path, 0o600)
    assert load_token(path) == "t0ken"
    monkeypatch.setenv("KVSIDECAR_TOKEN", "from-env")
    assert load_token() == "from-env"
    _, _, mon = make_toy()
    srv = SidecarServer(mon.metrics.registry, mon.summary, port=0, token="t0ken").start()
    try:
        assert _get(srv.url + "/status")[0] == 401
        assert _get(srv.url + "/status", {"Authorization": "Bearer nope"})[0] == 401
        assert _get(srv.url + "/status", {"Authorization": "Bearer t0ken"})[0] == 200
        assert _get(srv.url + "/metrics")[0] == 200
    finally:
        srv.stop()


def test_garbage_allocator_state_cannot_break_every_scrape() -> None:
    """Found by the bench's adapter faults: a list from allocator() was stored and then
    made every /metrics scrape and /status raise."""
    from prometheus_client import generate_latest

    from sidecar.core.protocol import AllocatorState

    _, adapter, mon = make_toy()
    for garbage in ([object(), None], AllocatorState(8, "x", 0, 0, 0, 0, 0)):  # type: ignore[arg-type]
        adapter.allocator = lambda g=garbage: g  # type: ignore[method-assign]
        assert mon.poll_allocator() is None
        generate_latest(mon.metrics.registry)
        json.dumps(mon.summary(), allow_nan=False)
    assert mon.metrics.value(S.ADAPTER_ERRORS.name, op="allocator", reason="garbage") == 2
