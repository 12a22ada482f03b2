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

from sidecar.adapters.sglang.tap import PoolGroup, SglangTap, key_fields
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
    [["frees", {"ids": [3]}], ["lookups", {"items": [[1]]}]],  # a malformed lookup
    [["frees", {"ids": [3]}], ["frees"]],  # not [kind, fields]
    [["frees", {"ids": [3]}], ["frees", [4]]],
    [["frees", {"ids": [3]}], [5, {}]],
])
def test_a_bad_run_ends_the_batch_after_what_came_before(runs: list[Any]) -> None:
    seen: list[tuple[str, Any]] = []
    rx = _receiver(seen)
    rx.handle(pack("events", runs=runs))
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
    sc = SimpleNamespace(metrics=m, _taps={}, tap_errors=0, tap_seconds=0.0)
    rx = ProbeReceiver("ipc:///tmp/kvs-unused.sock", m, lambda items: None,
                       lambda cap: None,
                       handlers={"tap_stats": lambda f: SglangSidecar._on_tap_stats(sc, f)})
    rx.handle(pack("events", "tap-1", runs=[["tap_stats", {"errors": 0, "busy_ns": 10**9}]]))
    rx.handle(pack("tap_stats", "tap-1", errors=0, busy_ns=3 * 10**9))
    rx.handle(pack("events", "tap-1", runs=[["tap_stats", {"errors": 0, "busy_ns": 4 * 10**9}]]))
    assert rx.bad_messages == 0 and sc.tap_seconds == pytest.approx(4.0)
