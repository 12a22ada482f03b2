"""The probe pipe accounts a drop by what it carried (sidecar/adapters/vllm/pipe.py): lookups
are held and delivered once the pipe drains, a dropped capture is a dropped sample whose
lookup still counts, and only what the bounded carry cannot hold is counted as lost."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sidecar import signals as S
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.wire import Capture, capture_fields
from sidecar.export.metrics import Metrics


def _capture(cid: str, query: int, hit: int) -> dict[str, object]:
    k = torch.zeros(1, 1, 2, 2)
    return capture_fields(cid, "hit", None, [1, 2], query, hit, {0: [5]}, [(0, 0, 5, k, k)])


def _wait(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 60  # bounds a hang only
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_lookups_and_sampled_hits_survive_a_full_pipe(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/p.sock"
    pipe = Pipe(endpoint, hwm=1)  # no sidecar yet: one message waits, the rest is refused
    sent_lookups = [[40 + i, 16 * (i % 3)] for i in range(30)]
    delivered = []
    for i in range(0, 30, 3):  # ten engine steps' lookups
        delivered.append(pipe.send_message("lookups", items=sent_lookups[i:i + 3]))
    captures = [pipe.send_message("capture", **_capture(f"c{i}", 64, 32)) for i in range(4)]
    assert not all(delivered) and not any(captures)  # the pipe really was full
    assert pipe.dropped == 4 and pipe.lost_lookups == 0 and pipe.lost_messages == 0
    assert pipe.carried == 30 - 3 + 4  # all but the first step's, plus the captures' lookups

    m = Metrics("vllm", "tiny")
    lookups: list[tuple[int, int]] = []
    caps: list[Capture] = []
    rx = ProbeReceiver(endpoint, m, lookups.extend, caps.append).start()
    try:
        _wait(lambda: rx.messages >= 1, "the queued message")
        # The next message (here an empty step) takes the carry along; a send refused
        # while the one-message queue still moves keeps it, and nothing is counted lost.
        _wait(lambda: pipe.send_message("lookups", items=[]) and pipe.carried == 0,
              "the carry sent")
        _wait(lambda: len(lookups) == 34, "the carried lookups")
    finally:
        pipe.close()
        rx.stop()
    expected = [tuple(x) for x in sent_lookups] + [(64, 32)] * 4
    assert sorted(lookups) == sorted(expected)  # every lookup, the dropped hits' included
    assert caps == [] and pipe.dropped == 4
    assert m.value(S.SAMPLES_DROPPED.name, reason="queue_full") == 4
    assert m.value(S.PROBE_LOST.name, what="lookups") == 0


def test_what_the_carry_cannot_hold_is_counted_lost(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/p.sock"
    pipe = Pipe(endpoint, hwm=1, carry_limit=5)
    pipe.send_message("hello", model="x")  # takes the one queued slot
    pipe.send_message("lookups", items=[[10, 0]] * 8)
    pipe.send_message("fingerprints", blocks=1)
    assert pipe.carried == 5 and pipe.lost_lookups == 3 and pipe.lost_messages >= 1
    m = Metrics("vllm", "tiny")
    lookups: list[tuple[int, int]] = []
    rx = ProbeReceiver(endpoint, m, lookups.extend, lambda c: None).start()
    try:
        _wait(lambda: rx.messages >= 1, "the hello")
        pipe.send_message("lookups", items=[[20, 16]])  # after the carry, sent or held
        _wait(lambda: pipe.send_message("lookups", items=[]) and pipe.carried == 0,
              "the carry sent")
        _wait(lambda: len(lookups) == 6, "the carried lookups")
    finally:
        pipe.close()
        rx.stop()
    assert lookups == [(10, 0)] * 5 + [(20, 16)]
    assert m.value(S.PROBE_LOST.name, what="lookups") == 3
    assert m.value(S.PROBE_LOST.name, what="messages") == pipe.lost_messages
    assert m.value(S.SAMPLES_DROPPED.name, reason="queue_full") == 0  # no sample was lost

