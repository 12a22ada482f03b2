"""Issue 21, bench stderr: the ``TypeError`` tracebacks that hostile hook input left in
``bench reliability``'s stderr (``store_index.forget``/``journal.drain``, the journal's
token hash, ``on_allocate`` generations) are now counted input rejects, and a probe
capture whose KV names a block outside its block table is a wire error, not a KeyError
in the adapter."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import pytest
from kvtestbed.bench.fuzz import _probe_corpus

from sidecar import signals as S
from sidecar.adapters.vllm.wire import WireError, decode_capture
from sidecar.core.protocol import BlockRef, StoredBlock
from tests.conftest import make_toy


class _UnreadableFields(Mapping[str, str]):
    """Key fields whose iteration raises (an outside check's: the store was accepted, then
    dropped where the journal applied it, with a traceback and no count)."""

    def __getitem__(self, key: str) -> str:
        return "a"

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("boom")


@pytest.mark.parametrize("hook,args", [
    ("on_free", (0, [None, 3])),
    ("on_free", (0, ["x"])),
    ("on_free", (0, [-1])),
    ("on_free", (0, [2**70])),
    ("on_store", (StoredBlock(0, 5, 0, [[1], [2]], 0),)),
    ("on_store", (StoredBlock(0, 5, 0, [1, 2], 0, key_fields=_UnreadableFields()),)),
    ("on_allocate", (0, 1, [1, 2], 5)),
    ("on_allocate", (0, 1, [None], [0])),
    ("on_release", (0, 1, [{"a": 1}])),
])
def test_hostile_cache_events_are_counted_rejects_not_tracebacks(caplog, hook, args) -> None:
    _, _, mon = make_toy()
    before = mon.metrics.value_sum(S.HOOK_INPUT_REJECTED.name)
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        getattr(mon, hook)(*args)
        mon.journal.drain()
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert tracebacks == [], [r.getMessage() for r in tracebacks]
    assert mon.metrics.value_sum(S.HOOK_INPUT_REJECTED.name) == before + 1
    assert mon.metrics.value_sum(S.HOOK_ERRORS.name) == 0


def test_numpy_like_block_ids_are_still_applied() -> None:
    torch = pytest.importorskip("torch")
    _, _, mon = make_toy()
    mon.on_free(0, [torch.tensor(3), 4])
    mon.journal.drain()
    assert mon.metrics.value_sum(S.HOOK_INPUT_REJECTED.name) == 0


@pytest.mark.parametrize("blocks,group", [({0: [5, 6]}, 52), ({}, 0), ({0: [5]}, 0)])
def test_capture_kv_outside_its_block_table_is_a_wire_error(blocks, group) -> None:
    msg = next(m for m in _probe_corpus() if m["kind"] == "capture")
    kv = [list(e) for e in msg["kv"]]  # entries for block #0 and #1 of group 0
    kv[0][0] = group
    with pytest.raises(WireError, match="block table"):
        decode_capture(dict(msg, blocks=blocks, kv=kv))


def test_a_capture_within_its_block_table_decodes() -> None:
    msg = next(m for m in _probe_corpus() if m["kind"] == "capture")
    cap = decode_capture(msg)
    assert sorted(cap.kv) == [(0, 0), (0, 1)]


def test_key_fields_are_taken_when_on_store_is_called() -> None:
    """An engine may reuse or change the mapping once the hook returns (outside check: a
    mapping changed after the call gave false key-field anomalies on every block)."""
    _, _, mon = make_toy()
    fields = {"adapter": "a", "lora": "7"}
    mon.on_store(StoredBlock(0, 5, 1, [1, 2], 0, key_fields=fields))
    fields["adapter"] = "CHANGED"
    del fields["lora"]
    mon.journal.drain()
    (record,) = mon.stored.snapshot([BlockRef(0, 0, 5)])[0].values()
    assert record is not None and dict(record.key_fields) == {"adapter": "a", "lora": "7"}
