"""Issue 12, breaks 1, 2 and 5: no probe message or KV event can crash, blind or poison the
sidecar. Each test is a reproduction from the issue."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from sidecar import signals as S
from sidecar.adapters.vllm.audit import EventAuditor
from sidecar.adapters.vllm.events import EventDecodeError, decode_message, encode_batch
from sidecar.adapters.vllm.hashing import external, hash_block, hash_function, none_hash
from sidecar.adapters.vllm.receiver import MAX_DROP_STEP, ProbeReceiver
from sidecar.adapters.vllm.subscriber import EventSubscriber
from sidecar.adapters.vllm.wire import WireError, pack, tensor_from
from sidecar.export.metrics import Metrics

BS = 4


def stored(i: int, **over: object) -> dict[str, object]:
    tokens = list(range(i * BS, (i + 1) * BS))
    fn = hash_function("sha256")
    parent = none_hash("sha256", None)
    assert parent is not None
    ev: dict[str, object] = {
        "type": "BlockStored", "block_hashes": [external(hash_block(fn, parent, tokens, None),
                                                         True)],
        "parent_block_hash": None, "token_ids": tokens, "block_size": BS, "lora_id": None,
        "medium": "GPU", "lora_name": None}
    ev.update(over)
    return ev


def nested(depth: int) -> object:
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


# ---------------------------------------------------------------- break 1: probe wire
def test_unlisted_dtype_is_refused_not_a_native_crash() -> None:
    """Today ``tensor_from(bytes(128), "qint8", ...)`` kills the process with SIGSEGV: run
    it, and a whole capture message through the receiver, in a child process."""
    code = """
import sys
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.wire import WireError, pack, tensor_from
from sidecar.export.metrics import Metrics
try:
    tensor_from(bytes(128), "qint8", [2, 2, 4, 8])
    sys.exit(3)
except WireError:
    pass
rx = ProbeReceiver("ipc:///tmp/unused-rel.sock", Metrics("v", "t"), lambda _: None,
                   lambda _: None)
rx.handle(pack("capture", id="x", role="hit", salt=None, tokens=[1] * 16, query_tokens=16,
               hit_tokens=16, blocks={0: [1, 2]},
               kv=[[0, 0, 1, "qint8", [2, 2, 4, 8], bytes(128), bytes(128)]]))
sys.exit(0 if rx.bad_messages == 1 else 4)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])


def test_byte_length_is_checked_before_a_tensor_is_built() -> None:
    with pytest.raises(WireError, match="needs 512"):
        tensor_from(bytes(100), "float32", [2, 2, 4, 8])
    with pytest.raises(WireError):
        tensor_from(bytes(16), "float32", [-1, 4])
    with pytest.raises(WireError):
        tensor_from(bytes(16), "__class__", [4])
    assert tensor_from(bytes(512), "float32", [2, 2, 4, 8]).shape == (2, 2, 4, 8)


# ---------------------------------------------------------------- break 2: KV events
def test_deep_extra_key_is_a_counted_decode_error_and_later_batches_apply() -> None:
    a = EventAuditor(Metrics("vllm", "t"))
    sub = EventSubscriber(a, "ipc:///unused")
    bad = encode_batch(0, [0.0, [stored(0, extra_keys=[[["mm-hash", nested(500)]]])]])
    assert len(bad[2]) < 2000  # a 644-byte class of message
    sub.handle_safely(bad)
    sub.handle_safely(encode_batch(1, [0.0, [stored(1)]]))
    s = a.summary()
    assert s["decode_errors"] == 1
    assert s["hashes_verified"] == 1


def test_msgpack_nesting_is_an_event_decode_error_not_recursion() -> None:
    # [ts, [{"type": [[[... 1000 deep]]]}]]: the error message's repr used to recurse
    payload = b"\x92\xcb" + bytes(8) + b"\x91\x81\xa4type" + b"\x91" * 1000 + b"\xc0"
    with pytest.raises(EventDecodeError):
        decode_message([b"", (0).to_bytes(8, "big"), payload])
    with pytest.raises(EventDecodeError):
        decode_message([b"", (0).to_bytes(8, "big"), b"\x91" * 5000 + b"\xc0"])


def test_oversized_payload_is_refused_before_decoding() -> None:
    big = msgpack.packb([0.0, [stored(0, lora_name="x" * 9_500_000)]])
    started = time.perf_counter()
    with pytest.raises(EventDecodeError) as err:
        decode_message([b"", (0).to_bytes(8, "big"), big])
    assert err.value.reason == "payload"
    assert time.perf_counter() - started < 1.0


def test_subscriber_thread_survives_any_exception_from_handle(tmp_path) -> None:
    a = EventAuditor(Metrics("vllm", "t"))
    real_apply, calls = a.apply, []

    def flaky(batch):  # the first batch blows up inside the auditor
        calls.append(batch.seq)
        if len(calls) == 1:
            raise RecursionError("hostile")
        real_apply(batch)

    a.apply = flaky  # type: ignore[method-assign]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    endpoint = f"ipc://{tmp_path}/ev.sock"
    pub.bind(endpoint)
    sub = EventSubscriber(a, endpoint, context=ctx).start()
    try:
        deadline = time.monotonic() + 10
        seq = 0
        while a.summary()["hashes_verified"] < 1 and time.monotonic() < deadline:
            pub.send_multipart(encode_batch(seq, [0.0, [stored(seq)]]))
            seq += 1
            time.sleep(0.05)
        assert sub.alive
        assert a.summary()["hashes_verified"] >= 1
        assert a.metrics.value(S.KV_EVENT_DECODE_ERRORS.name, reason="handle") == 1
    finally:
        sub.stop()
        pub.close(0)
        ctx.term()


def test_audit_index_is_bounded_and_evictions_counted() -> None:
    a = EventAuditor(Metrics("vllm", "t"), max_indexed=100)
    for j in range(10):  # 1000 stores whose removals never arrive
        a.apply(decode_message(encode_batch(j, [0.0, [stored(j * 100 + i)
                                                      for i in range(100)]])))
    assert a.index_size == 100
    assert a.summary()["index_evictions"] == 900
    assert a.indexed(0, "GPU") == 100


# ---------------------------------------------------------------- break 5: peers
def test_labels_come_from_describe_not_from_the_wire() -> None:
    m = Metrics("vllm", "t")
    a = EventAuditor(m, groups=[0])
    for j in range(300):
        a.apply(decode_message(encode_batch(j, [0.0, [
            stored(j, medium=f"m{j}", group_idx=j)]])))
    series = [s for fam in m.registry.collect() for s in fam.samples
              if s.name.startswith("kvsidecar_kv_")]
    assert len(series) < 60, len(series)
    groups = {s.labels.get("group") for s in series if "group" in s.labels}
    media = {s.labels.get("medium") for s in series if "medium" in s.labels}
    assert groups <= {"0", "other"} and media <= {"GPU", "none", "other"}


def test_peer_drop_counts_are_clamped(tmp_path) -> None:
    m = Metrics("vllm", "t")
    rx = ProbeReceiver(f"ipc://{tmp_path}/p.sock", m, lambda _: None, lambda _: None)
    rx.handle(pack("lookups", src="sched", dropped=2**63 - 1, items=[[8, 4]]))
    rx.handle(pack("lookups", src="sched", dropped=-5, items=[]))
    for i in range(200):  # new sources cannot mint unbounded state
        rx.handle(pack("lookups", src=f"s{i}", dropped=1, items=[]))
    assert m.value(S.SAMPLES_DROPPED.name, reason="queue_full") <= MAX_DROP_STEP + 200
    assert len(rx._dropped) <= 64


def test_capture_cannot_choose_its_group_label(tmp_path) -> None:
    caps: list[object] = []
    rx = ProbeReceiver(f"ipc://{tmp_path}/p.sock", Metrics("v", "t"), lambda _: None,
                       caps.append, groups=[0])
    kv = [[99, 0, 1, "float32", [1, 1, 1, 1], bytes(4), bytes(4)]]
    rx.handle(pack("capture", id="x", role="hit", salt=None, tokens=[1] * 4, query_tokens=5,
                   hit_tokens=4, blocks={99: [1]}, kv=kv))
    assert caps == [] and rx.bad_messages == 1
    rx.handle(pack("capture", id="y", role="hit", salt=None, tokens=[1] * 4, query_tokens=5,
                   hit_tokens=4, blocks={0: [1]}, kv=[[0, *kv[0][1:]]]))
    assert len(caps) == 1


def test_probe_ipc_socket_is_owner_only_and_endpoints_allow_listed(tmp_path) -> None:
    rx = ProbeReceiver(f"ipc://{tmp_path}/p.sock", Metrics("v", "t"), lambda _: None,
                       lambda _: None).start()
    try:
        assert (tmp_path / "p.sock").stat().st_mode & 0o777 == 0o600
    finally:
        rx.stop()
    for bad in ("tcp://0.0.0.0:5555", "tcp://*:5555", "ipc:///etc/kvsidecar.sock"):
        with pytest.raises(ValueError):
            ProbeReceiver(bad, Metrics("v", "t"), lambda _: None, lambda _: None)
        with pytest.raises(ValueError):  # a bound event socket is held to the same rule
            EventSubscriber(EventAuditor(Metrics("v", "t")), bad, bind=True)


def test_handle_never_raises_under_mutation() -> None:
    """A short seeded mutation fuzz (the bench runs >= 100k): nothing escapes, threads live."""
    from kvtestbed.bench.reliability import fuzz_events, fuzz_probe

    for result in (fuzz_events(2000, seed=1), fuzz_probe(2000, seed=2)):
        assert result.escaped == 0 and result.cases == 2000, result
    assert threading.active_count() < 50


def test_bench_ingest_reports_side_by_side_rates() -> None:
    """The lead's ``bench perf`` row (issue 10): numbers, not a timed assertion."""
    from sidecar.adapters.vllm.audit import bench_ingest

    out = bench_ingest(2000, repeats=1)
    assert out["hashes_verified"] == out["events"] == 2000
    assert out["ingest_events_per_s"] > 0 and out["msgpack_events_per_s"] > 0
    assert 0 < out["ingest_vs_msgpack"] < 10


def test_peer_drop_counts_are_bounded_across_senders(tmp_path) -> None:
    """Issue 21 break 8: each message was clamped, but two senders at 2**63-1 still added
    2 x MAX_DROP_STEP, and every repeat of the same claim added another step."""
    from sidecar.adapters.vllm.receiver import DROP_BURST, DropBudget

    now = [0.0]
    m = Metrics("vllm", "t")
    rx = ProbeReceiver(f"ipc://{tmp_path}/p.sock", m, lambda _: None, lambda _: None)
    rx.drop_budget = DropBudget(rate_per_s=1000, burst=DROP_BURST, clock=lambda: now[0])
    for _ in range(5):
        for src in ("sched", "worker"):
            rx.handle(pack("lookups", src=src, dropped=2**63 - 1, items=[]))
    counted = m.value(S.SAMPLES_DROPPED.name, reason="queue_full")
    assert 0 < counted <= DROP_BURST, counted
    assert rx.drops_refused >= 2 * (2**63 - 1) - DROP_BURST
    now[0] += 10.0  # ten seconds later: at most rate x 10 more, from an honest new claim
    rx.handle(pack("lookups", src="third", dropped=2**63 - 1, items=[]))
    assert m.value(S.SAMPLES_DROPPED.name, reason="queue_full") <= counted + 10_000
    rx.handle(pack("lookups", src="honest", dropped=3, items=[]))  # honest drops still count
    now[0] += 1.0
    rx.handle(pack("lookups", src="honest2", dropped=3, items=[]))
    assert m.value(S.SAMPLES_DROPPED.name, reason="queue_full") >= counted + 3
