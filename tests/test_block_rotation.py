"""Coverage-driven block choice: consecutive samples of one prefix rotate through its earlier
blocks, so a bad middle block is checked within the prefix's length in samples; the cursors
are bounded; the vLLM probe's chooser is the core's (no null blocks)."""

from __future__ import annotations

import random
from typing import Any

import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.sequence import Request

from sidecar.adapters.vllm.groups import choose_group_blocks, groups_from_config
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import CacheGroup, GroupKind, Hit, Lookup
from sidecar.core.sampling import BlockCursors, UniformSampler, choose_blocks
from tests.limits import DETECTION_TIMEOUT_S

BS = 16


def _hit(last: int, n: int = 8) -> Hit:
    ids = list(range(last - n + 1, last + 1))
    return Hit(tokens=list(range(n * BS + 3)), hit_tokens=n * BS, blocks={0: ids})


def test_consecutive_samples_of_a_prefix_cover_every_block_within_its_length() -> None:
    for seed in range(50):
        sampler = UniformSampler(1, seed=seed)
        seen: set[int] = set()
        for _ in range(7):  # 8 blocks: the last every time, one of the other 7 in turn
            refs = sampler.choose(_hit(100), BS, 2)
            assert refs[-1].index == 7 and len(refs) == 2
            seen.update(r.index for r in refs)
        assert seen == set(range(8)), seed
    random_pick = [choose_blocks(_hit(100), BS, 2, random.Random(s)) for s in range(7)]
    assert len({r.index for refs in random_pick for r in refs}) < 8  # what rotation fixes


def test_prefixes_rotate_apart_and_the_cursor_memory_is_bounded() -> None:
    cursors = BlockCursors(random.Random(0), capacity=4)
    rng = random.Random(0)
    a = [choose_blocks(_hit(100), BS, 3, rng, cursors=cursors) for _ in range(4)]
    b = choose_blocks(_hit(200), BS, 3, rng, cursors=cursors)
    assert len({r.index for refs in a for r in refs}) == 8  # 7 earlier, 2 per sample: 4 samples
    assert len(b) == 3
    for last in range(300, 320):
        choose_blocks(_hit(last), BS, 2, rng, cursors=cursors)
    assert len(cursors) == 4


def test_vllm_chooser_is_the_cores_and_never_picks_null_blocks() -> None:
    gemma2 = {"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 64}
    groups = groups_from_config(gemma2) + (CacheGroup(
        2, GroupKind.RECURRENT_STATE, (4,), null_block_ids=frozenset({0})),)
    hit = Hit(tokens=list(range(256)), hit_tokens=256,
              blocks={0: [0] * 6 + [21, 22], 1: list(range(24, 32)), 2: [0] * 7 + [40]})
    cursors = BlockCursors(random.Random(1))
    full: set[int] = set()
    for _ in range(4):
        refs = choose_group_blocks(hit, groups, 32, 3, random.Random(0), cursors)
        assert all(r.block_id != 0 for r in refs)
        full.update(r.index for r in refs if r.group_id == 1)
    assert full == set(range(8))  # the full group's 7 earlier blocks, 2 per sample
    # a null block where the group must hold KV is not chosen (coverage finds it)
    holed = Hit(tokens=list(range(256)), hit_tokens=256,
                blocks={0: [0] * 8, 1: list(range(24, 32)), 2: [0] * 8})
    refs = choose_group_blocks(holed, groups, 32, 3, random.Random(0))
    assert {r.group_id for r in refs} == {1}


class _LastHit:
    """An event sink in front of the Monitor that remembers the last hit's blocks."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.blocks: list[int] = []

    def on_lookup(self, lookup: Lookup) -> None:
        if lookup.hit is not None:
            self.blocks = list(lookup.hit.blocks[0])
        self.monitor.on_lookup(lookup)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.monitor, name)


def test_a_zeroed_middle_block_of_an_8_block_prefix_is_checked_within_8_sampled_hits() -> None:
    for seed in range(3):
        engine = ReferenceEngine(EngineConfig(num_blocks=64))
        monitor = Monitor(ReferenceAdapter(engine), SidecarConfig(
            sample_every=1, blocks_per_sample=2, dispatch="inline", seed=seed,
            allocator_every_s=0.0, adapter_timeout_s=DETECTION_TIMEOUT_S))
        sink = _LastHit(monitor)
        engine.sink = sink  # type: ignore[assignment]
        bs = engine.block_size
        prompt = [(7 * i + seed) % 200 + 1 for i in range(8 * bs + 1)]
        engine.serve(Request(list(prompt), max_new_tokens=1))
        engine.serve(Request(list(prompt), max_new_tokens=1))  # a hit: learn the block ids
        assert len(sink.blocks) == 8
        for store in (engine.pool.key, engine.pool.value):
            store[:, sink.blocks[3]] = torch.zeros_like(store[:, sink.blocks[3]])
        caught_at = None
        for n in range(1, 9):
            before = sum(monitor.summary()["anomalies"].values())
            engine.serve(Request(list(prompt), max_new_tokens=1))
            if sum(monitor.summary()["anomalies"].values()) > before:
                caught_at = n
                break
        assert caught_at is not None and caught_at <= 8, seed
