"""The SGLang tap's shipper: SGLang's thread queues, the tap's own thread packs and sends,
in the order things happened, several hand-overs as one message (hello, a capture and a
census go at once, with what waits before them); a full queue and an unpackable message are
accounted as the pipe accounts what it could not send."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from sidecar.adapters.sglang import tap as T
from sidecar.adapters.sglang.tap import PoolGroup, SglangTap, key_fields
from sidecar.adapters.vllm.wire import unpack

BS = 4


class FakePool:
    def __init__(self, slots: int) -> None:
        self.k_buffer = [torch.randn(slots + 1, 2, 8) for _ in range(2)]
        self.v_buffer = [torch.randn(slots + 1, 2, 8) for _ in range(2)]


def _recording(tap: SglangTap) -> list[tuple[str, dict[str, Any]]]:
    """What the tap's pipe puts on its socket, with the sending thread's name."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def raw_send(data: bytes) -> bool:
        sent.append((threading.current_thread().name, unpack(data)))
        return True

    tap.pipe._raw_send = raw_send  # type: ignore[method-assign]
    return sent


@pytest.fixture
def quiet_shipper(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipper ships only when woken (a full queue, close): what it merges does not
    depend on how fast this machine runs the test."""
    monkeypatch.setattr(T, "SHIP_EVERY_S", 3600.0)


def _events(msgs: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Every message's content, flattened in order: (kind, item) per event, the item for
    lookups and frees only."""
    out: list[tuple[str, Any]] = []
    for m in msgs:
        if m["kind"] != "events":
            out.append((m["kind"], None))
            continue
        for kind, f in m["runs"]:
            items = f.get("items", f.get("ids"))
            out.extend((kind, tuple(i) if kind == "lookups" else i if kind == "frees" else None)
                       for i in (items if items is not None else [None]))
    return out


def test_only_the_shipper_sends_in_order_and_merged(tmp_path: Any, quiet_shipper: None
                                                    ) -> None:
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=1, census_every_s=3600)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    f = key_fields(None, None)
    path = torch.arange(1, 13)
    tap.inserted(list(range(12)), path, 0, f)  # stores 4, 8, 12
    tap.admitted("a", list(range(12)), 0, path, f)  # a miss: a lookup
    tap.released("a")  # the last one out: a hand-over, with the stats
    tap.freed(torch.tensor([4]))
    tap.admitted("b", list(range(12)), 2, path, f)  # no full block: a lookup
    tap.released("b")  # a second hand-over
    tap.admitted("c", list(range(12)), 8, path, f)  # a hit, sampled: wakes the shipper
    tap.released("c")
    tap.close()
    msgs = [m for _, m in sent]
    kinds = [m["kind"] for m in msgs]
    # hello at once; the two hand-overs before the capture leave as one message, sent with
    # the capture at once on the hook's thread; the rest by the shipper
    assert kinds[:3] == ["hello", "events", "capture"], kinds
    assert [who for who, _ in sent[:3]] == [threading.current_thread().name] * 3
    assert _events(msgs)[:9] == [
        ("hello", None), ("stores", None), ("stores", None), ("stores", None),
        ("lookups", (12, 0)), ("tap_stats", None), ("frees", 4), ("lookups", (12, 2)),
        ("tap_stats", None)]
    assert msgs[-1]["kind"] == "tap_stats" and msgs[-1]["errors"] == 0
    assert tap.pipe.dropped == tap.pipe.lost_messages == tap.pipe.lost_lookups == 0


def test_a_full_queue_counts_what_it_could_not_take(tmp_path: Any, quiet_shipper: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "READY_LIMIT", 2)
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=3600)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")  # sent at once
    f = key_fields(None, None)
    path = torch.arange(1, 13)
    for rid in ("a", "b", "c", "d"):  # each the last one out: four hand-overs, two taken
        tap.admitted(rid, list(range(12)), 8, path, f)
        tap.released(rid)
    tap.inserted(list(range(12)), path, 0, f)
    tap.flush()  # stores, not taken either
    # b's and c's lookups carried; their stats, and the stores, lost messages
    assert tap.pipe.carried == 2 and tap.pipe.lost_messages == 3
    tap.close()
    lookups = [i for _, m in sent for i in (
        m["items"] if m["kind"] == "lookups" else
        [x for k, r in m.get("runs", ()) if k == "lookups" for x in r["items"]])]
    assert lookups == [[12, 8]] * 4  # none lost: two carried, sent first
    assert tap.pipe.lost_lookups == 0


def test_an_unpackable_message_is_counted_and_the_next_still_goes(
        tmp_path: Any, quiet_shipper: None) -> None:
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=3600)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    tap._post("stores", ["\ud800"])  # a lone surrogate: msgpack cannot encode it
    tap.flush()
    tap._send("alloc_failed", {"n": 1})  # between: the two hand-overs are not merged
    tap._post("lookups", [[12, 8]])
    tap.close()
    kinds = [m["kind"] for _, m in sent]
    assert kinds == ["hello", "alloc_failed", "events", "tap_stats"], kinds
    assert sent[2][1]["runs"] == [["lookups", {"items": [[12, 8]]}]]
    assert sent[-1][1]["errors"] == 1 and tap.pipe.lost_messages == 1


def test_key_values_msgpack_cannot_encode_travel_hashed() -> None:
    """A client chooses ``extra_key``: one with a lone surrogate (JSON can carry it) would
    make every store and capture naming it unpackable; it travels as its hash."""
    fields = key_fields("tenant-\ud800", None)
    assert fields["extra_key"].startswith("sha256:") and fields["cache_salt"] == ""
    assert key_fields("tenant-\ud800", None) == fields != key_fields("tenant-\ud801", None)
    assert key_fields("tenant-é", "salt") == {"extra_key": "tenant-é", "cache_salt": "salt"}


def test_events_queued_on_sglang_thread_leave_from_the_shipper(tmp_path: Any,
                                                               quiet_shipper: None) -> None:
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=3600)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    for rid in ("a", "b"):
        tap.admitted(rid, list(range(12)), 8, torch.arange(1, 13), key_fields(None, None))
        tap.released(rid)
    assert [m["kind"] for _, m in sent] == ["hello"]  # queued, not sent
    tap.close()
    assert [(who, m["kind"]) for who, m in sent[1:]] == [
        ("kvsidecar-sglang-ship", "events"), ("kvsidecar-sglang-ship", "tap_stats")]
    assert [r[0] for r in sent[1][1]["runs"]] == ["lookups", "tap_stats"] * 2
