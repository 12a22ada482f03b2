"""The SGLang tap's census within its budget: a census costs in proportion to the pool (a
bitmap of every slot, three times), so the next one waits at least its own time over
``census_share``; and the allocated bitmap is packed straight from the tap's mask, the same
bits the id list gave."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from sidecar.adapters.sglang import tap as tap_module
from sidecar.adapters.sglang.slot_ids import bitmap
from sidecar.adapters.sglang.tap import PoolGroup, SglangTap
from sidecar.adapters.vllm.wire import unpack


class FakePool:
    def __init__(self, slots: int) -> None:
        self.k_buffer = [torch.zeros(slots + 1, 2, 8) for _ in range(2)]
        self.v_buffer = [torch.zeros(slots + 1, 2, 8) for _ in range(2)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def _tap(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, **kw: Any
         ) -> tuple[SglangTap, Clock, list[dict[str, Any]]]:
    clock = Clock()
    monkeypatch.setattr(tap_module.time, "monotonic", clock.monotonic)
    tap = SglangTap(f"ipc://{tmp_path}/p.sock", 4, sample_every=10**9, **kw)
    sent: list[dict[str, Any]] = []
    tap.pipe._raw_send = lambda data: sent.append(unpack(data)) or True  # type: ignore
    tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
    return tap, clock, sent


def _census(tap: SglangTap, clock: Clock, took_s: float) -> None:
    """What the backend does: ask, let SGLang read its pool (``took_s``), hand it over."""
    assert tap.census_due()
    clock.now += took_s
    tap.census(torch.arange(1, 65), torch.zeros(0, dtype=torch.int64), 0, 0, True)


def test_a_costly_census_waits_in_proportion_to_its_cost(tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tap, clock, sent = _tap(tmp_path, monkeypatch, census_every_s=1.0, census_share=0.002)
    began = clock.now
    _census(tap, clock, 0.004)  # 4 ms, SGLang's reads included: next at 4 / 0.002 = 2 s on
    clock.now = began + 1.5
    assert not tap.census_due()  # census_every_s alone would have said yes
    clock.now = began + 2.001
    _census(tap, clock, 0.0001)  # a cheap one: back to census_every_s
    began = clock.now - 0.0001
    clock.now = began + 0.99
    assert not tap.census_due()
    clock.now = began + 1.001
    assert tap.census_due()
    tap.close()
    assert [m["kind"] for m in sent].count("census") == 2


def test_a_tiny_share_still_leaves_a_census_every_few_minutes(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    tap, clock, _ = _tap(tmp_path, monkeypatch, census_every_s=1.0, census_share=1e-300)
    began = clock.now
    _census(tap, clock, 0.01)
    clock.now = began + tap_module.MAX_CENSUS_WAIT_S - 1
    assert not tap.census_due()
    clock.now = began + tap_module.MAX_CENSUS_WAIT_S + 0.001
    assert tap.census_due()
    tap.close()


def test_a_server_going_quiet_is_censused_within_the_budget_alone(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last running request's release: the census is due once its own cost allows,
    whatever census_every_s says (the sidecar's idle leak check needs an idle census)."""
    tap, clock, _ = _tap(tmp_path, monkeypatch, census_every_s=60.0, census_share=0.002)
    began = clock.now
    _census(tap, clock, 0.001)  # next by cost: 0.5 s on; by the period: 60 s on
    clock.now = began + 0.4
    assert not tap.census_due(quiet=True)
    clock.now = began + 0.501
    assert not tap.census_due()  # a busy server waits for the period
    assert tap.census_due(quiet=True)
    quiet_began = clock.now
    tap.census(torch.arange(1, 65), torch.zeros(0, dtype=torch.int64), 0, 0, True)
    clock.now = quiet_began + 59  # the budget allows it, but a quiet one was taken
    assert not tap.census_due(quiet=True)  # (a server whose batches all end together)
    clock.now = quiet_began + 60.001
    assert tap.census_due(quiet=True)
    tap.close()


def test_no_share_means_only_the_period(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """census_share 0 (the live tests: a census at every chance): the cost sets no wait."""
    tap, clock, _ = _tap(tmp_path, monkeypatch, census_every_s=0.0, census_share=0.0)
    _census(tap, clock, 5.0)
    assert tap.census_due()
    tap.close()


def test_allocated_bitmap_is_the_mask_less_held_back(tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tap, _, sent = _tap(tmp_path, monkeypatch, census_every_s=0.0, census_share=0.0)
    tap.allocated(torch.tensor([3, 5, 7, 64]))
    tap.allocated(torch.tensor([9]))
    tap.freed(torch.tensor([5]))
    assert tap.census_due()
    tap.census(torch.arange(10, 20), torch.zeros(0, dtype=torch.int64), 0, 0, False,
               held_back=torch.tensor([9]))
    tap.close()
    census = next(m for m in sent if m["kind"] == "census")
    assert census["allocated"] == bitmap(np.array([3, 7, 64]), tap.size)
    bits = np.unpackbits(np.frombuffer(census["allocated"], dtype=np.uint8))[:tap.size]
    assert np.flatnonzero(bits).tolist() == [3, 7, 64]
    assert tap._allocated[9]  # the tap's own map is not changed by a census
