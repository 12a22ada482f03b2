"""One ``events`` message per flush of SGLang's tap outbox (issue 24: a message per run of one
kind cost SGLang's thread a pack and a ZMQ send per event, since kinds alternate per
request). The receiver handles each run as the message of that kind would be, in order; a
dropped batch keeps its lookups and counts one lost message."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.adapters.sglang.key_values import key_fields
from sidecar.adapters.sglang.tap import PoolGroup, SglangTap
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.wire import pack, unpack
from sidecar.export.metrics import Metrics


def _receiver(seen: list[tuple[str, Any]]) -> ProbeReceiver:
    return ProbeReceiver("ipc:///tmp/kvs-unused.sock", Metrics("sglang", "tiny"),
                         lambda items: seen.append(("lookups", items)), lambda cap: None,
                         handlers={"stores": lambda m: seen.append(("stores", m["items"])),
                                   "frees": lambda m: seen.append(("frees", m["ids"])),
                                   "tap_stats": lambda m: seen.append(("stats", m))})


def test_runs_are_handled_in_order_as_their_own_messages() -> None:
    seen: list[tuple[str, Any]] = []
    rx = _receiver(seen)
    store = [7, 0, [1, 2, 3, 4], None, {}]
    rx.handle(pack("events", "tap-1", runs=[["lookups", {"items": [[12, 8]]}],
                                   ["stores", {"items": [store]}], ["frees", {"ids": [7]}],
                                   ["lookups", {"items": [[20, 16]]}],
                                   ["tap_stats", {"errors": 0, "busy_ns": 5}]]))
    assert seen == [("lookups", [(12, 8)]), ("stores", [store]), ("frees", [7]),
                    ("lookups", [(20, 16)]),
                    # sent by the batch's sender: a tap's stats are kept per sender
                    ("stats", {"errors": 0, "busy_ns": 5, "src": "tap-1"})]
    assert rx.messages == 1 and rx.bad_messages == 0


@pytest.mark.parametrize("runs", [
    [["frees", {"ids": [3]}], ["capture", {}]],  # a capture never rides in a batch
    [["frees", {"ids": [3]}], ["events", {"runs": []}]],  # nor a nested batch
    [["frees", {"ids": [3]}], ["hello", {}]],
    [["frees", {"ids": [3]}], ["census", {}]],  # a census is checked alone
    [["frees", {"ids": [3]}], ["frees"]],  # not [kind, fields]
    [["frees", {"ids": [3]}], ["frees", [4]]],
    [["frees", {"ids": [3]}], [5, {}]],
    [["lookups", {"items": [[1, 0]] * 40_000}]] * 7,  # 280k items: over the batch's cap
])
def test_a_batch_of_a_bad_shape_or_kind_is_refused_whole(runs: list[Any]) -> None:
    seen: list[tuple[str, Any]] = []
    rx = _receiver(seen)
    rx.handle(pack("events", runs=runs))
    assert seen == [] and rx.bad_messages == 1 and rx.messages == 0


def test_a_bad_item_ends_the_batch_after_what_came_before() -> None:
    seen: list[tuple[str, Any]] = []
    rx = _receiver(seen)
    rx.handle(pack("events", runs=[["frees", {"ids": [3]}], ["lookups", {"items": [[1]]}],
                                   ["frees", {"ids": [4]}]]))
    assert seen == [("frees", [3])] and rx.bad_messages == 1 and rx.messages == 0


@pytest.mark.parametrize("runs", [None, {"a": 1}, "x", [["frees", {"ids": [1]}]] * 70_000])
def test_a_batch_that_is_not_a_bounded_list_is_refused_whole(runs: Any) -> None:
    seen: list[tuple[str, Any]] = []
    rx = _receiver(seen)
    rx.handle(pack("events", runs=runs))
    assert seen == [] and rx.bad_messages == 1


def test_a_dropped_batch_keeps_its_lookups_and_counts_one_lost_message(tmp_path: Path) -> None:
    pipe = Pipe(f"ipc://{tmp_path}/p.sock", hwm=1)  # no sidecar: one message waits
    assert pipe.send_message("tap_stats", errors=0, busy_ns=0)
    runs = [["lookups", {"items": [[12, 8], [30, 16]]}], ["frees", {"ids": [4]}],
            ["lookups", {"items": [[40, 0]]}]]
    assert not pipe.send_message("events", runs=runs)
    assert pipe.carried == 3 and pipe.lost_messages == 1 and pipe.lost_lookups == 0
    assert not pipe.send_message("events", runs=[["lookups", {"items": [[9, 0]]}]])
    assert pipe.carried == 4 and pipe.lost_messages == 1  # lookups alone lose no message
    pipe.close()


class _Pool:
    """SGLang's NHD pool layout, two layers (slots, kv_heads, head_dim)."""

    def __init__(self, slots: int) -> None:
        self.k_buffer = [torch.zeros(slots + 1, 1, 2) for _ in range(2)]
        self.v_buffer = [torch.zeros(slots + 1, 1, 2) for _ in range(2)]


def test_a_flush_is_one_message_in_the_order_things_happened(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/p.sock"
    raw: list[dict[str, Any]] = []
    seen: list[tuple[str, Any]] = []
    rx = ProbeReceiver(endpoint, Metrics("sglang", "tiny"),
                       lambda items: seen.append(("lookups", items)), lambda cap: None,
                       groups=[0],
                       handlers={"stores": lambda m: seen.append(("stores", len(m["items"]))),
                                 "frees": lambda m: seen.append(("frees", m["ids"])),
                                 "tap_stats": lambda m: seen.append(("stats", m["errors"]))})
    handle = rx.handle
    rx.handle = lambda data: (raw.append(unpack(data)), handle(data))  # type: ignore[method-assign]
    rx.start()
    try:
        tap = SglangTap(endpoint, 4, sample_every=10**9, census_every_s=3600)
        tap.attach([PoolGroup.full(_Pool(64))], 64, "0.5.23", "tiny")
        f = key_fields(None, None)
        path = torch.arange(1, 9)
        tap.admitted("a", list(range(12)), 0, path[:0], f)
        tap.inserted(list(range(8)), path, 0, f)  # two blocks stored
        tap.freed(path[3:4])  # the first block's last slot
        tap.admitted("b", list(range(8)), 4, path[:4], f)
        tap.released("a")
        tap.released("b")  # the last one out: one message, the stats last
        deadline = time.monotonic() + 60  # bounds a hang only
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        tap.close()
    finally:
        rx.stop()
    batches = [m for m in raw if m["kind"] == "events"]
    assert len(batches) == 1 and [r[0] for r in batches[0]["runs"]] == [
        "lookups", "stores", "frees", "lookups", "tap_stats"]
    assert seen[:5] == [("lookups", [(12, 0)]), ("stores", 2), ("frees", [4]),
                        ("lookups", [(8, 4)]), ("stats", 0)]


def test_stats_in_a_batch_and_alone_count_once_per_tap() -> None:
    """A tap's stats ride in a batch when the server goes quiet and alone with a census:
    both name the same sender, so its cumulative time counts once (a batch's runs once
    lost the sender and counted as a second tap: the bench's tap time doubled)."""
    from types import SimpleNamespace

    from sidecar import signals as S
    from sidecar.adapters.sglang.service import SglangSidecar

    m = Metrics("sglang", "tiny")
    m.register(S.SGLANG_SIGNALS)
    now = [0.0]
    sc = SimpleNamespace(metrics=m, _taps={}, tap_errors=0, tap_seconds=0.0,
                         _clock=lambda: now[0])
    rx = ProbeReceiver("ipc:///tmp/kvs-unused.sock", m, lambda items: None,
                       lambda cap: None,
                       handlers={"tap_stats": lambda f: SglangSidecar._on_tap_stats(sc, f)})
    rx.handle(pack("events", "tap-1", runs=[["tap_stats", {"errors": 0, "busy_ns": 10**9}]]))
    now[0] += 10.0
    rx.handle(pack("tap_stats", "tap-1", errors=0, busy_ns=3 * 10**9))
    now[0] += 10.0
    rx.handle(pack("events", "tap-1", runs=[["tap_stats", {"errors": 0, "busy_ns": 4 * 10**9}]]))
    # from the first stats on (the baseline), one tap: 3 s
    assert rx.bad_messages == 0 and sc.tap_seconds == pytest.approx(3.0)


def test_key_field_values_are_bounded_at_the_tap_and_checked_at_the_sidecar() -> None:
    """A client chooses SGLang's extra_key: an outside check pinned 200 MB of the sidecar
    with 20 MB keys in stores (captures refused them, so such a hit was never verified).
    The tap sends a long value as its SHA-256; the sidecar holds stores to a capture's rule."""
    from sidecar.adapters.sglang.key_values import KEY_VALUE_CHARS
    from sidecar.adapters.vllm.wire import WireError, decode_key_fields

    short, long_a, long_b = "ns-1", "A" * 20_000_000, "A" * 19_999_999 + "B"
    f = key_fields(short, None)
    assert f == {"extra_key": "ns-1", "cache_salt": ""}
    fa, fb = key_fields(long_a, None), key_fields(long_b, long_a)
    assert fa["extra_key"].startswith("sha256:") and len(fa["extra_key"]) <= KEY_VALUE_CHARS
    assert fa["extra_key"] != fb["extra_key"] and fa["extra_key"] == fb["cache_salt"]
    assert decode_key_fields(fa) == fa
    with pytest.raises(WireError):
        decode_key_fields({"extra_key": "x" * 2000})


def test_only_lookups_the_monitor_takes_count_toward_the_hit_audit() -> None:
    """The audited count of hit tokens took lookups the Monitor refused (hit > query,
    2**62 tokens): an outside check drove it past 2**63."""
    from types import SimpleNamespace

    from sidecar.adapters.sglang.service import SglangSidecar

    taken: list[Any] = []
    sc = SimpleNamespace(counted_hit_tokens=0, monitor=SimpleNamespace(on_lookup=taken.append))
    SglangSidecar._on_lookups(sc, [(3, 99), (10, 2**62), (20, 16), (-1, 0), (8, 8)])
    assert sc.counted_hit_tokens == 24 and len(taken) == 5  # the Monitor counts its refusals


def test_freed_blocks_counts_only_blocks_that_were_stored() -> None:
    """An outside check drove ``freed_blocks`` with frees of ids never stored: only a free
    of a block the tap stored (and did not free yet) counts."""
    from types import SimpleNamespace

    from sidecar.adapters.sglang.service import SglangSidecar

    freed: list[list[int]] = []
    sc = SimpleNamespace(_stored=set(), freed_blocks=0, full_group=0,
                         monitor=SimpleNamespace(on_store=lambda b: None,
                                                 on_free=lambda g, ids: freed.append(ids)))
    SglangSidecar._on_stores(sc, {"items": [[7, 0, [1] * 4, None, {}],  # type: ignore[arg-type]
                                            [9, 4, [2] * 4, None, {}]]})
    SglangSidecar._on_frees(sc, {"ids": [7, 8, 10**12, 7]})  # type: ignore[arg-type]
    SglangSidecar._on_frees(sc, {"ids": [7, 9]})  # type: ignore[arg-type]
    assert sc.freed_blocks == 2 and freed == [[7, 8, 10**12, 7], [7, 9]]


def test_a_flood_of_bad_messages_is_no_log_flood(caplog: Any) -> None:
    """Each bad message is counted; the 1st, 2nd, 4th, ... are logged (an outside check
    wrote 19,525 warnings from 20,000 forged messages in 0.3 s)."""
    import logging

    rx = _receiver([])
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        for _ in range(1000):
            rx.handle(b"not msgpack")
    assert rx.bad_messages == 1000
    assert len([r for r in caplog.records if "probe message skipped" in r.message]) == 10
