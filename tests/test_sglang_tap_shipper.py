"""The SGLang tap's shipper: SGLang's thread queues, the tap's own thread packs and sends,
in the order things happened, several hand-overs as one message (hello, a capture and a
census go at once, with what waits before them); a full queue and an unpackable message are
accounted as the pipe accounts what it could not send."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from sidecar.adapters.sglang import tap_shipper as T
from sidecar.adapters.sglang.key_values import key_fields
from sidecar.adapters.sglang.tap import PoolGroup, SglangTap
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


def _sidecar_that_can_go_away(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, up_at_start: bool
                              ) -> tuple[SglangTap, list[tuple[str, dict[str, Any]]], list[bool]]:
    """An attached tap with a short ship period whose socket takes messages only while
    ``up[0]`` (the sidecar there; ``up_at_start`` when the hello goes)."""
    monkeypatch.setattr(T, "SHIP_EVERY_S", 0.01)
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=3600)
    sent = _recording(tap)
    up = [up_at_start]
    recording = tap.pipe._raw_send
    tap.pipe._raw_send = lambda data: up[0] and recording(data)  # type: ignore[method-assign]
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    return tap, sent, up


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
    tap.shipper.send("alloc_failed", {"n": 1})  # between: the two hand-overs are not merged
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


def test_a_hand_over_past_the_receivers_cap_leaves_in_pieces(tmp_path: Any,
                                                             quiet_shipper: None) -> None:
    """A cache flush frees every stored block in one run: the receiver refuses a message
    of more than 2**18 items, so the shipper splits what one hook handed over."""
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=3600)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    n = 3 * T.RUN_ITEMS + 5
    tap._post("lookups", [[12, 8]])
    tap._post("frees", list(range(n)))
    tap.flush(stats=True)
    tap.close()
    events = [m for _, m in sent if m["kind"] == "events"]
    assert len(events) >= 4 and all(
        sum(len(f.get("ids", f.get("items", ()))) for _, f in m["runs"]) <= T.RUN_ITEMS
        for m in events)
    assert [i for m in events for k, f in m["runs"] if k == "frees" for i in f["ids"]] == \
        list(range(n))
    kinds = [k for m in events for k, _ in m["runs"]]
    assert kinds[0] == "lookups" and kinds[-1] == "tap_stats"


def test_a_long_request_does_not_hold_the_others_events(tmp_path: Any, quiet_shipper: None,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """One request decoding for long keeps the tap's last-one-out hand-over from firing:
    its allocations (every decode step) hand over what has waited a period."""
    from sidecar.adapters.sglang import tap as tap_module

    now = [1000.0]
    monkeypatch.setattr(tap_module.time, "monotonic", lambda: now[0])
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=3600)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    f = key_fields(None, None)
    tap.admitted("long", list(range(40)), 0, torch.arange(1, 41), f)
    tap.admitted("short", list(range(12)), 8, torch.arange(1, 13), f)
    tap.released("short")  # "long" still runs: nothing handed over
    tap.allocated(torch.tensor([50]))  # a decode step within the period
    assert tap._waiting == 2
    now[0] += T.SHIP_EVERY_S
    tap.allocated(torch.tensor([51]))  # past it: handed over
    assert tap._waiting == 0
    tap.shipper.ship()
    assert [i for _, m in sent if m["kind"] == "events" for k, r in m["runs"]
            if k == "lookups" for i in r["items"]] == [[40, 0], [12, 8]]
    tap.close()


def test_a_backlog_is_not_sent_on_sglangs_thread(tmp_path: Any, quiet_shipper: None) -> None:
    """A census goes at once with what waits before it, unless the shipper is behind (more
    than WAKE_AT waiting): then the shipper is woken and SGLang's thread returns."""
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=0)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    with tap.shipper._lock:  # the shipper is behind: it cannot drain while this is held
        for _ in range(T.WAKE_AT + 1):
            tap.shipper.send("alloc_failed", {"n": 1})
        free = torch.arange(1, 65)
        tap.census(free, torch.zeros(0, dtype=torch.int64), 0, 0, True)  # returns at once
        assert [m["kind"] for _, m in sent] == ["hello"]
    tap.close()
    kinds = [m["kind"] for _, m in sent]
    assert kinds.count("alloc_failed") == T.WAKE_AT + 1 and "census" in kinds
    assert kinds.index("census") > max(i for i, k in enumerate(kinds) if k == "alloc_failed")


def test_lookups_carried_through_an_outage_leave_on_a_quiet_server(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipe carries the lookups it could not send; once the sidecar is back, the shipper
    retries them by itself: a server gone quiet must not keep them until its next request."""
    import time

    tap, sent, up = _sidecar_that_can_go_away(tmp_path, monkeypatch, up_at_start=False)
    for rid in ("a", "b"):
        tap.admitted(rid, list(range(12)), 8, torch.arange(1, 13), key_fields(None, None))
        tap.released(rid)
    deadline = time.monotonic() + 60  # bounds a hang only
    while tap.pipe.carried < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tap.pipe.carried == 2 and sent == []
    up[0] = True  # the sidecar is back; no more traffic
    while tap.pipe.carried and time.monotonic() < deadline:
        time.sleep(0.01)
    tap.close()
    assert [i for _, m in sent if m["kind"] == "lookups" for i in m["items"]] == [[12, 8]] * 2


def test_a_census_behind_thousands_of_events_wakes_the_shipper(tmp_path: Any,
                                                               quiet_shipper: None) -> None:
    """One message can hold thousands of events (a long prompt's stores): a census behind
    it must not pack them on SGLang's thread; and the events waiting are bounded too."""
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", BS, sample_every=10**9, census_every_s=0)
    sent = _recording(tap)
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    with tap.shipper._lock:  # the shipper cannot drain while this is held
        tap._post("frees", list(range(T.AT_ONCE_ITEMS + 1)))  # one hand-over
        tap.census(torch.arange(1, 65), torch.zeros(0, dtype=torch.int64), 0, 0, True)
        assert [m["kind"] for _, m in sent] == ["hello"]  # returned at once
        tap._post("frees", list(range(T.READY_ITEMS)))  # past the events bound: not taken
        tap.flush()
        assert tap.pipe.lost_messages == 1
    tap.close()
    kinds = [m["kind"] for _, m in sent]
    assert "census" in kinds and kinds.index("census") > kinds.index("events")


def test_a_loss_is_told_on_a_quiet_server(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A batch of stores lost while the sidecar was away, then no traffic: the shipper
    tells the loss once the sidecar is back (the count rides on every message), without
    counting its own tries while it is still away."""
    import time

    tap, sent, up = _sidecar_that_can_go_away(tmp_path, monkeypatch, up_at_start=True)
    up[0] = False
    tap.inserted(list(range(12)), torch.arange(1, 13), 0, key_fields(None, None))
    tap.flush()
    deadline = time.monotonic() + 60  # bounds a hang only
    while tap.pipe.lost_messages < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # ~10 periods of tries while away
    assert tap.pipe.lost_messages == 1 and [m["kind"] for _, m in sent] == ["hello"]
    up[0] = True
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    tap.close()
    assert sent[1][1]["kind"] == "tap_stats" and sent[1][1]["lost_messages"] == 1
