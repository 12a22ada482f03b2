"""The adapter never changes what LMCache does: its own failures are counted, LMCache's
results and exceptions reach the caller unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar import signals as S
from tests.lmcache.harness import build
from tests.lmcache.test_tiers import prompt

pytestmark = pytest.mark.lmcache


def test_a_failing_capture_is_counted_and_retrieve_still_returns(tmp_path: Path) -> None:
    rig = build(tmp_path)
    try:
        tokens = prompt(5)
        rig.serve(tokens)

        def broken(kwargs: Any, start: int, end: int) -> Any:
            raise RuntimeError("served-KV reader bug")

        rig.adapter.served = broken
        kv = torch.zeros_like(rig.prefill_kv(tokens))
        loaded = rig.adapter.retrieve(tokens, kvcaches=kv)
        assert bool(loaded.all()) and torch.equal(kv, rig.prefill_kv(tokens))
        assert rig.monitor.drain(60)
        m = rig.monitor.metrics
        assert m.value(S.HOOK_ERRORS.name, hook="capture") == 1
        # Without the capture the chunk is still verified, from the tier's copy.
        assert m.value_sum(S.LMCACHE_VERIFIED_CHUNKS.name) >= 1
        assert m.value_sum(S.ANOMALIES.name) == 0
    finally:
        rig.close()


def test_lmcache_own_errors_propagate_unchanged(tmp_path: Path) -> None:
    rig = build(tmp_path)
    try:
        tokens = prompt(6)
        rig.serve(tokens)
        with pytest.raises(KeyError, match="kvcaches"):  # the connector needs its buffer
            rig.adapter.retrieve(tokens)
        assert rig.monitor.metrics.value_sum(S.HOOK_ERRORS.name) == 0
        # The tap recorded nothing for the failed call and keeps working after it.
        kv = torch.zeros_like(rig.prefill_kv(tokens))
        assert bool(rig.adapter.retrieve(tokens, kvcaches=kv).all())
        assert rig.monitor.drain(60)
        assert rig.monitor.metrics.value(S.LOOKUPS.name) == 1
    finally:
        rig.close()
