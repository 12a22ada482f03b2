"""An adapter's ``capture`` runs on the engine's thread inside ``on_lookup``, so whatever it
does must stay there: a BaseException (SystemExit, KeyboardInterrupt, GeneratorExit, an
adapter's own) or garbage returned is counted under ``hook_errors_total{hook="capture"}``
and the sample goes on without its capture (the verifier reads the blocks instead), never
raised into the engine (found by an outside check: four BaseExceptions came out of
``on_lookup`` and garbage lost its samples uncounted)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive

from sidecar import signals as S
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, Hit
from tests.limits import DETECTION_TIMEOUT_S


class Oops(BaseException):
    pass


def _returns(value: object):
    return lambda hit, refs: value


def _raises(exc: BaseException):
    def capture(hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        raise exc
    return capture


BAD_CAPTURES = {
    "SystemExit": _raises(SystemExit(3)),
    "KeyboardInterrupt": _raises(KeyboardInterrupt()),
    "GeneratorExit": _raises(GeneratorExit()),
    "BaseException": _raises(Oops("an adapter's own")),
    "None": _returns(None),
    "list of None": _returns([None]),
    "block without tensors": lambda hit, refs: [BlockKV(refs[0], None, None)],  # type: ignore[arg-type]
}


@pytest.mark.parametrize("name", sorted(BAD_CAPTURES))
def test_a_hostile_capture_is_counted_and_its_sample_still_verified(name: str) -> None:
    torch.manual_seed(0)
    engine = ReferenceEngine(EngineConfig(num_blocks=128))
    adapter = ReferenceAdapter(engine)
    adapter.capture = BAD_CAPTURES[name]  # type: ignore[method-assign]
    monitor = Monitor(adapter, SidecarConfig(sample_every=1, burst_hits=0,
                                             adapter_timeout_s=DETECTION_TIMEOUT_S))
    engine.sink = monitor
    monitor.start()
    try:
        drive(engine, ChatWorkload(WorkloadConfig(seed=0, conversations=4,
                                                  block_size=engine.block_size)),
              max_requests=12)
        assert monitor.drain(DETECTION_TIMEOUT_S)
    finally:
        monitor.stop()
    assert not engine.sink_errors  # nothing came out of a hook
    failed = monitor.metrics.value(S.HOOK_ERRORS.name, hook="capture")
    summary = monitor.summary()
    assert summary["sampled"] >= 1 and failed == summary["sampled"]
    assert summary["verified"] >= 1  # read instead of captured
    assert summary["anomalies"] == {} or not any(summary["anomalies"].values())


@pytest.mark.parametrize("name", ["SystemExit", "KeyboardInterrupt", "None",
                                  "block without tensors"])
def test_the_process_front_counts_a_hostile_capture_and_ships_the_lookup(
        tmp_path: object, name: str) -> None:
    """``dispatch = "process"``: the front copies at match time too (no later read there),
    so a capture that fails is a counted ``adapter_error`` drop; its lookup still ships."""
    from sidecar.core.protocol import Lookup
    from tests.test_process_dispatch import _drive, _front, _received

    front, pull = _front(tmp_path, sample_every=1)
    _drive(front.adapter.engine, 12)
    front._capture = BAD_CAPTURES[name]
    front.on_lookup(Lookup(64, 64, Hit(list(range(64)), 64, {0: [0, 1, 2, 3]})))
    assert front.hook_errors["capture"] == 1 and front.dropped["adapter_error"] == 1
    assert front.ship() == 1
    got = _received(pull)
    assert [k for m in got for k, _ in m.get("runs", [])] == ["lookups"]
    assert not [m for m in got if m["kind"] == "capture"]
    front.pipe.close()
    pull.close(0)
