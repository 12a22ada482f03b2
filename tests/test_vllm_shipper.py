"""The vLLM probe's worker half copies a sampled hit's blocks into preallocated slots on the
engine's step and ships them from a thread of its own (sidecar/adapters/vllm/shipper.py):
what arrives is the block as the engine's layout held it at the step, a later overwrite of
the engine's block does not reach it, and a capture that finds no slot or a full queue is
accounted like a dropped sample whose lookup still counts."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from sidecar.adapters.vllm.layout import block_views, decode_block, encode_cpu_block
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.shipper import Shipper, Staged
from sidecar.adapters.vllm.wire import Capture, capture_fields
from sidecar.export.metrics import Metrics

H, BS, D, LAYERS = 2, 32, 16, 3


def _pool() -> list[torch.Tensor]:
    """Three layers of vLLM's CPU layout, 4 blocks each, every block distinct."""
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        pool = torch.zeros(4, H, BS, 2 * D)
        for b in range(4):
            pool[b] = encode_cpu_block(torch.randn(H, BS, D), torch.randn(H, BS, D))
        layers.append(pool)
    return layers


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 60  # bounds a hang only
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _post(shipper: Shipper, layers: list[torch.Tensor], cid: str, block_ids: list[int],
          lookup: dict[str, Any]) -> bool:
    """What the probe's ``_capture`` does on the engine's step."""
    kv: list[Staged] = []
    for index, b in enumerate(block_ids):
        slot = shipper.stage(0, block_views(layers, b, BS))
        if slot is None:
            shipper.refuse_capture(lookup)
            return False
        kv.append((0, index, b, slot[0], slot[1]))

    def build(host: list[Staged]) -> dict[str, Any]:
        return capture_fields(cid, "hit", None, [1] * (BS * len(block_ids)), 100, 64,
                              {0: block_ids}, host)

    return shipper.post_capture(build, kv, lookup)


def test_a_shipped_capture_is_the_block_at_the_step_not_a_later_overwrite(
        tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/p.sock"
    m = Metrics("vllm", "tiny")
    caps: list[Capture] = []
    rx = ProbeReceiver(endpoint, m, lambda _: None, caps.append).start()
    layers = _pool()
    expected = [decode_block(layers, b, BS) for b in (1, 3)]
    shipper = Shipper(Pipe(endpoint), slots=4)
    release = threading.Event()
    gate = shipper.pipe.send_message

    def held(kind: str, **fields: Any) -> bool:  # the shipper thread waits here
        release.wait(60)
        return gate(kind, **fields)

    shipper.pipe.send_message = held  # type: ignore[method-assign]
    try:
        lookup = {"role": "hit", "query_tokens": 100, "hit_tokens": 64}
        assert _post(shipper, layers, "c1", [1, 3], lookup)
        for t in layers:  # the engine reuses both blocks on its next step
            t[1].fill_(7.0)
            t[3].fill_(7.0)
        release.set()
        _wait(lambda: len(caps) == 1, "the capture")
    finally:
        shipper.close()
        rx.stop()
    cap = caps[0]
    for index, (k, v) in enumerate(expected):
        got_k, got_v = cap.kv[(0, index)]
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert shipper.shipped == 1 and shipper.refused == 0
    _wait(lambda: shipper._buffers[0].free_slots == 4, "the slots freed once shipped")


def test_no_free_slot_or_a_full_queue_is_a_dropped_sample_whose_lookup_counts(
        tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/p.sock"
    layers = _pool()
    shipper = Shipper(Pipe(endpoint), slots=3, depth=1)
    release = threading.Event()
    started = threading.Event()
    gate = shipper.pipe.send_message

    def held(kind: str, **fields: Any) -> bool:
        started.set()
        release.wait(60)
        return gate(kind, **fields)

    shipper.pipe.send_message = held  # type: ignore[method-assign]
    lookup = {"role": "hit", "query_tokens": 90, "hit_tokens": 32}
    try:
        assert _post(shipper, layers, "c1", [0], lookup)  # the thread takes it, then waits
        _wait(started.is_set, "the shipper thread holding c1")
        assert _post(shipper, layers, "c2", [1], lookup)  # queued (depth 1)
        assert not _post(shipper, layers, "c3", [2], lookup)  # a slot, but the queue is full
        assert shipper.refused == 1 and shipper.pipe.dropped == 1
        assert shipper.pipe.carried == 1  # its lookup rides with the next message
        _wait(lambda: shipper._buffers[0].free_slots == 1, "c3's slot given back")
        held_slot = shipper.stage(0, block_views(layers, 3, BS))  # the last free slot
        assert held_slot is not None
        assert not _post(shipper, layers, "c4", [2], lookup)  # no free slot
        assert shipper.refused == 2 and shipper.pipe.dropped == 2
        assert shipper.pipe.carried == 2
        ref = {"role": "reference", "query_tokens": 90, "hit_tokens": 32}
        assert not _post(shipper, layers, "c5", [2], ref)  # the sidecar's own: no lookup
        assert shipper.refused == 3 and shipper.pipe.carried == 2
    finally:
        release.set()
        shipper.close()
    assert shipper.shipped == 2
