"""The adapter protocol: adapters conform, groups are first-class, errors are clear."""

from __future__ import annotations

import pytest

from sidecar.adapters.reference import ReferenceAdapter
from sidecar.engines.reference.engine import EngineConfig, ReferenceEngine
from sidecar.guard import AdapterTimeout
from sidecar.monitor import Monitor, SidecarConfig
from sidecar.protocol import Adapter, BlockRef, CacheGroup, EngineInfo, GroupKind, Hit
from tests.toy import ToyAdapter, ToyEngine


def test_shipped_adapters_satisfy_the_protocol():
    engine = ReferenceEngine(EngineConfig(num_blocks=16))
    assert isinstance(ReferenceAdapter(engine), Adapter)
    assert isinstance(ToyAdapter(ToyEngine(sink=None)), Adapter)


def test_reference_adapter_describes_one_full_attention_group():
    engine = ReferenceEngine(EngineConfig(num_blocks=16))
    info = ReferenceAdapter(engine).describe()
    assert [g.kind for g in info.groups] == [GroupKind.FULL_ATTENTION]
    assert info.groups[0].layers == (0, 1)
    assert {"model_revision", "adapter", "cache_salt"} <= set(info.key_fields)
    assert info.block_size == 16 and info.dtype == "float32"


def test_engine_info_names_unknown_groups_clearly():
    info = EngineInfo("e", "m", "r", "float32", 16, 2, 16,
                      (CacheGroup(0, GroupKind.FULL_ATTENTION, (0,)),
                       CacheGroup(1, GroupKind.SLIDING_WINDOW, (1,), sliding_window=64,
                                  name="swa")))
    assert info.group(1).label == "swa" and info.group(0).label == "0"
    with pytest.raises(KeyError, match="no cache group 7"):
        info.group(7)


def test_hybrid_hits_are_sampled_per_group():
    from sidecar.sampling import UniformSampler

    hit = Hit(list(range(64)), 64, {0: [1, 2, 3, 4], 1: [9, 10, 11, 12]})
    refs = UniformSampler(1).choose(hit, 16, 2)
    assert {r.group_id for r in refs} == {0, 1}
    assert all(r.index == 3 for r in refs if r.block_id in (4, 12))
    assert BlockRef(1, 3, 12) in refs


class _HangingDescribe(ToyAdapter):
    def describe(self):
        import time
        time.sleep(5)
        return super().describe()


class _BrokenDescribe(ToyAdapter):
    def describe(self):
        raise RuntimeError("engine not ready")


def test_describe_failures_are_clear_errors_at_startup():
    with pytest.raises(RuntimeError, match="engine not ready"):
        Monitor(_BrokenDescribe(ToyEngine(sink=None)))
    with pytest.raises(AdapterTimeout, match="describe"):
        Monitor(_HangingDescribe(ToyEngine(sink=None)), SidecarConfig(adapter_timeout_s=0.1))
