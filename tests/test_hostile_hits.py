"""Sampled hits whose insides turn hostile after the engine's thread let them through (the
engine's thread checks a sampled hit's shape and the ids it picks; the verifier checks the
rest on a copy): each is one counted drop with its reason, never a hook error, a traceback
or a false anomaly, and what the lifecycle log keeps of it stays readable. Found by an
outside check of the split (a float tensor as a block id was a hook error; an int subclass
whose hash raised broke ``lifecycle.path`` and the evidence of a later real anomaly)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from kvtestbed.bench.floods import good_lookup, reference

from sidecar import signals as S
from sidecar.core.dispatch import Dispatcher
from sidecar.core.protocol import Hit, Lookup, TierState


class _RaisingIndex:
    def __index__(self) -> int:
        raise RuntimeError("hostile __index__")


class _HashBomb(int):
    def __hash__(self) -> int:
        raise RuntimeError("hostile __hash__")


class _RaisingGet(dict[Any, Any]):
    def __getitem__(self, k: Any) -> Any:
        raise RuntimeError("hostile __getitem__")

    def get(self, *a: Any) -> Any:
        raise RuntimeError("hostile get")


@pytest.fixture(scope="module")
def sampled():  # type: ignore[no-untyped-def]
    engine, mon = reference(sample_every=1, dispatch="inline")
    yield mon, good_lookup(engine)
    mon.stop()


def _with(good: Lookup, **fields: Any) -> Lookup:
    """The good hit (its real blocks, generations and key fields) with ``fields`` replaced."""
    h = good.hit
    base: dict[str, Any] = {"tokens": h.tokens, "hit_tokens": h.hit_tokens,
                            "blocks": h.blocks, "generations": h.generations,
                            "key_fields": h.key_fields}
    base.update(fields)
    return Lookup(good.query_tokens, good.hit_tokens, Hit(**base))


def _counts(mon: Any) -> tuple[float, float, float]:
    m = mon.metrics
    return (m.value_sum(S.HOOK_INPUT_REJECTED.name), m.value_sum(S.HOOK_ERRORS.name),
            m.value_sum(S.ANOMALIES.name))


def _bad_ids(good: Lookup, bad: object) -> list[Lookup]:
    """The hit with ``bad`` at every position of its block list, in turn (picked or not)."""
    ids = list(good.hit.blocks[0])
    return [_with(good, blocks={0: [bad if i == j else b for i, b in enumerate(ids)]})
            for j in range(len(ids))]


@pytest.mark.parametrize("bad", [_RaisingIndex(), torch.tensor(3.0), np.array([3]), None])
def test_a_bad_id_anywhere_is_one_counted_drop(sampled, caplog, bad: object) -> None:
    mon, good = sampled
    for lookup in _bad_ids(good, bad):
        rejected, errors, anomalies = _counts(mon)
        with caplog.at_level(logging.WARNING):
            mon.on_lookup(lookup)
        assert _counts(mon) == (rejected + 1, errors, anomalies)
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("fields", [
    {"tier_states": {0: [1, 1, 1, 1]}},  # ints, not TierState: was 4 false anomalies
    {"tier_states": {0: (TierState.LOADED, "x")}},
])
def test_tier_states_that_are_not_states_are_refused(sampled, caplog,
                                                      fields: dict[str, Any]) -> None:
    mon, good = sampled
    rejected, errors, anomalies = _counts(mon)
    with caplog.at_level(logging.WARNING):
        mon.on_lookup(_with(good, **fields))
    assert _counts(mon) == (rejected + 1, errors, anomalies)
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("field", ["blocks", "key_fields", "generations"])
def test_a_map_whose_get_raises_is_read_once_and_never_again(sampled, caplog,
                                                             field: str) -> None:
    """The verifier reads its copy of the hit (``items()`` read once), not the engine's
    map: a map whose ``get``/``[]`` raise was a traceback and an ``adapter_error`` drop.
    The engine's thread reads a generation by ``get`` (the lifecycle's hit event): there
    such a map is one counted drop."""
    mon, good = sampled
    (rejected, errors, anomalies), verified = _counts(mon), mon.metrics.value_sum(
        S.VERIFIED.name)
    with caplog.at_level(logging.WARNING):
        mon.on_lookup(_with(good, **{field: _RaisingGet(getattr(good.hit, field))}))
    refused = field == "generations"
    assert _counts(mon) == (rejected + refused, errors, anomalies)
    assert (mon.metrics.value_sum(S.VERIFIED.name) > verified) is not refused
    assert not [r for r in caplog.records if r.exc_info]


def test_ids_that_are_ints_by_index_are_verified_and_read_back_as_plain_ints(sampled) -> None:
    """numpy/torch integer scalars and int subclasses are ids (verified), kept as plain ints:
    the lifecycle log, its JSON and its per-block path read them whatever their hash does."""
    mon, good = sampled
    real = list(good.hit.blocks[0])
    for ids in ([np.int64(b) for b in real], [torch.tensor(b) for b in real],
                [_HashBomb(b) for b in real]):
        rejected, errors, anomalies = _counts(mon)
        verified = mon.metrics.value_sum(S.VERIFIED.name)
        mon.on_lookup(_with(good, blocks={0: ids}))
        assert _counts(mon) == (rejected, errors, anomalies)
        assert mon.metrics.value_sum(S.VERIFIED.name) > verified
    path = mon.lifecycle.path(0, real[:1], limit=10_000)  # hashes every id it reads
    json.dumps(path)
    hits = [e for e in path if e["op"] == "hit"]
    assert len(hits) >= 3 and all(type(b) is int for e in hits for b in e["blocks"])


def test_a_worker_stuck_past_stop_leaves_when_its_call_returns() -> None:
    """stop() that times out on a stuck verification, then start(): once the stuck call
    returns, its worker leaves instead of verifying beside the new one."""
    release, running = threading.Event(), threading.Event()
    seen: list[str] = []

    def verify(sample: Any) -> Any:
        seen.append(threading.current_thread().name + str(threading.get_ident()))
        if sample == "stuck":
            running.set()
            release.wait(30)
        return sample

    d = Dispatcher(verify, lambda v: None, lambda why: None, "queued", 8)
    d.start()
    d.submit("stuck")  # type: ignore[arg-type]
    assert running.wait(10)
    d.stop(timeout_s=0.05)
    d.start()
    release.set()
    deadline = time.monotonic() + 10
    while sum(t.name == "kvsidecar-verifier" for t in threading.enumerate()) > 1 \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(t.name == "kvsidecar-verifier" for t in threading.enumerate()) == 1
    for i in range(20):
        d.submit(str(i))  # type: ignore[arg-type]
    assert d.drain(10)
    assert len(set(seen[1:])) == 1  # every later sample on the one new worker
    d.stop()
