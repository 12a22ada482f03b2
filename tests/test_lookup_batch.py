"""The vLLM probe's scheduler half sends lookups in batches: at most one message per period,
at once when a batch is full, and when the last scheduled request finishes (an engine going
quiet keeps nothing back). No vLLM needed: the batch is the probe's, the pipe is real."""

from __future__ import annotations

from typing import Any

from sidecar.adapters.vllm.lookup_batch import MAX_LIVE, LookupBatch
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.wire import MAX_LOOKUPS, unpack


def _batch(tmp_path: Any) -> tuple[LookupBatch, list[list[list[int]]], list[float]]:
    pipe = Pipe(f"ipc://{tmp_path}/p.sock")
    sent: list[list[list[int]]] = []

    def raw_send(data: bytes) -> bool:
        msg = unpack(data)
        assert msg["kind"] == "lookups"
        sent.append(msg["items"])
        return True

    pipe._raw_send = raw_send  # type: ignore[method-assign]
    now = [100.0]
    return LookupBatch(pipe, every_s=0.25, clock=lambda: now[0]), sent, now


def test_lookups_leave_once_per_period_and_when_the_last_request_finishes(tmp_path: Any
                                                                          ) -> None:
    batch, sent, now = _batch(tmp_path)
    batch.scheduled(["a"], [[10, 0]])  # the first goes at once
    assert sent == [[[10, 0]]]
    for i, rid in enumerate(("b", "c", "d")):  # steps within the period: held
        now[0] += 0.05
        batch.scheduled([rid], [[10 + i, 8]])
    assert len(sent) == 1 and batch.waiting == 3
    batch.scheduled(["ref"], [])  # a reference recompute: scheduled, not a lookup
    for rid in ("a", "b", "c", "d"):
        batch.finished(rid)
    assert len(sent) == 1  # "ref" still runs
    batch.finished("unknown")  # never scheduled here: changes nothing
    assert len(sent) == 1
    batch.finished("ref")  # the last one out
    assert sent[1] == [[10, 8], [11, 8], [12, 8]] and batch.waiting == 0
    now[0] += 0.3
    batch.scheduled(["e"], [[5, 0]])  # a new period: at once
    assert sent[2] == [[5, 0]] and batch.sent == 3


def test_a_full_batch_leaves_at_once_and_the_live_set_is_bounded(tmp_path: Any) -> None:
    batch, sent, _ = _batch(tmp_path)
    batch.scheduled(["first"], [[1, 0]])
    batch.scheduled([f"r{i}" for i in range(MAX_LOOKUPS - 1)], [[2, 0]] * (MAX_LOOKUPS - 1))
    assert len(sent) == 1
    batch.scheduled(["full"], [[3, 0]])  # the receiver's cap per message reached
    assert len(sent) == 2 and len(sent[1]) == MAX_LOOKUPS and batch.waiting == 0
    batch.scheduled([f"x{i}" for i in range(MAX_LIVE + 5)], [])
    assert len(batch._live) == MAX_LIVE  # oldest forgotten: memory stays bounded


def test_waiting_lookups_leave_with_a_later_step_that_has_none(tmp_path: Any) -> None:
    """A long request keeps the engine stepping (decode) with nothing new to look up: what
    waits leaves with the first step past the period, not when that request finishes."""
    batch, sent, now = _batch(tmp_path)
    batch.scheduled(["long"], [[40, 0]])  # at once
    now[0] += 0.05
    batch.scheduled(["short"], [[12, 8]])
    batch.finished("short")  # "long" still runs: held
    for _ in range(3):  # decode steps within the period
        now[0] += 0.05
        batch.scheduled([], [])
    assert len(sent) == 1
    now[0] += 0.2
    batch.scheduled([], [])
    assert sent[1] == [[12, 8]] and batch.waiting == 0
