"""The adapter protocol: adapters conform, groups are first-class, errors are clear."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Sequence

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine

import sidecar.adapters
from sidecar.core.conformance import check_adapter, check_protocol
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import (
    Adapter,
    AllocatorState,
    BlockKV,
    BlockRef,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
)
from sidecar.core.time_limits import AdapterTimeout
from tests.toy import ToyAdapter, ToyEngine


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
    from sidecar.core.sampling import UniformSampler

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


# ---------------------------------------------------------------- signature conformance
ADAPTER_METHODS = ("describe", "read", "recompute", "allocator")


def _adapter_classes() -> dict[str, type]:
    """Every class under sidecar.adapters that looks like an adapter (defines most of the
    protocol's methods), so an adapter added later is checked without editing this test."""
    import kvtestbed.adapters

    found: dict[str, type] = {}
    for info in [*pkgutil.walk_packages(sidecar.adapters.__path__, "sidecar.adapters."),
                 *pkgutil.walk_packages(kvtestbed.adapters.__path__, "kvtestbed.adapters.")]:
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] == "vllm":
                continue  # the in-engine probe runs inside vLLM (tests/vllm covers it)
            raise
        for cls in vars(module).values():
            if (inspect.isclass(cls) and cls.__module__ == module.__name__
                    and sum(hasattr(cls, m) for m in ADAPTER_METHODS) >= 3):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def _vllm_info() -> EngineInfo:
    return EngineInfo("vllm", "tiny", "local", "bfloat16", 16, 2, 16,
                      (CacheGroup(0, GroupKind.FULL_ATTENTION, (0, 1)),))


def test_every_shipped_adapter_has_the_protocol_signatures():
    classes = _adapter_classes()
    # Discovery must find the adapters we know of, or it proves nothing.
    assert {"kvtestbed.adapters.paged_adapter.ReferenceAdapter",
            "sidecar.adapters.vllm.adapter.VllmAdapter"} <= set(classes)
    for cls in [*classes.values(), ToyAdapter]:
        assert check_adapter(cls) == [], cls
    from sidecar.adapters.vllm.adapter import VllmAdapter

    instances = [ReferenceAdapter(ReferenceEngine(EngineConfig(num_blocks=16))),
                 VllmAdapter(_vllm_info(), None), ToyAdapter(ToyEngine(sink=None))]
    for adapter in instances:
        assert isinstance(adapter, Adapter)
        assert check_adapter(adapter) == [], type(adapter)


def test_the_monitor_has_the_event_sink_signatures():
    from sidecar.core.capabilities import BlockLifecycleSink
    from sidecar.core.protocol import EventSink

    assert check_protocol(Monitor, EventSink) == []
    assert check_protocol(Monitor, BlockLifecycleSink) == []


def test_vllm_references_have_the_reference_signature():
    from sidecar.adapters.vllm.reference import EngineReference, HFReference, Reference

    for cls in (HFReference, EngineReference):
        assert check_protocol(cls, Reference) == [], cls


class _WrongArity:
    def describe(self) -> EngineInfo: ...
    def read(self, hit: Hit) -> list[BlockKV]: ...  # forgot refs
    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...
    def allocator(self) -> AllocatorState | None: ...


class _Swapped(_WrongArity):
    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...
    def recompute(self, refs: Sequence[BlockRef], hit: Hit) -> list[BlockKV]: ...


class _ExtraRequired(_Swapped):
    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...
    def describe(self, verbose: bool) -> EngineInfo: ...


class _KeywordOnly(_ExtraRequired):
    def describe(self) -> EngineInfo: ...
    def read(self, *, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...


class _Async(_KeywordOnly):
    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...
    async def allocator(self) -> AllocatorState | None: ...


class _BadIntrospection(_Async):
    def allocator(self) -> AllocatorState | None: ...
    def block_tables(self, group_id: int) -> list: ...


@pytest.mark.parametrize(("cls", "expected"), [
    (_WrongArity, "read() takes 1 positional argument(s), the protocol passes 2 (hit, refs)"),
    (_Swapped, "recompute(): parameter 1 is 'refs', the protocol names it 'hit'"),
    (_ExtraRequired, "describe(): requires 'verbose', which the protocol never passes"),
    (_KeywordOnly, "read() takes 0 positional argument(s)"),
    (_Async, "allocator() is async"),
    (_BadIntrospection, "AllocatorIntrospection: block_tables(): requires 'group_id'"),
])
def test_wrong_signatures_pass_isinstance_but_not_the_conformance_check(cls, expected):
    adapter = cls()
    assert isinstance(adapter, Adapter)  # what the protocol alone lets through
    problems = check_adapter(adapter)
    assert any(expected in p for p in problems), problems
    assert all(p.startswith(f"{cls.__name__}: ") for p in problems)


def test_missing_and_non_callable_members_are_named():
    class Partial:
        describe = "not a method"

        def read(self, hit, refs): ...

    problems = check_adapter(Partial())
    assert "Partial: Adapter: 'describe' is not callable" in problems
    assert "Partial: Adapter: missing method 'recompute'" in problems
    assert "Partial: Adapter: missing method 'allocator'" in problems


def test_compatible_variations_conform():
    class Lenient:
        def describe(self, *args, **kwargs) -> EngineInfo: ...
        def read(self, hit, refs, *, deadline: float = 1.0) -> list[BlockKV]: ...
        def recompute(self, hit, refs, extra=None) -> list[BlockKV]: ...
        @staticmethod
        def allocator() -> AllocatorState | None: ...
        def block_tables(self): ...

    assert check_adapter(Lenient()) == []
    assert check_adapter(Lenient) == []


def test_the_radix_test_adapter_has_the_protocol_signatures():
    """The second cache shape (tests/radix_adapter.py: a radix tree over a token-slot pool)
    conforms like the shipped adapters, allocator introspection included."""
    from sidecar.core.capabilities import AllocatorIntrospection
    from tests.radix_adapter import RadixAdapter
    from tests.radix_engine import RadixEngine

    assert check_adapter(RadixAdapter) == []
    adapter = RadixAdapter(RadixEngine(num_slots=64))
    assert isinstance(adapter, Adapter) and isinstance(adapter, AllocatorIntrospection)
    assert check_adapter(adapter) == []
