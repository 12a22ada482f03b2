"""Sampling policies beside 1-in-N: the budget they spend and the hits they favour."""

from __future__ import annotations

import random

import pytest

from sidecar.core.protocol import Hit, StoredBlock
from sidecar.core.sampling import (
    AdaptiveSampler,
    BoundaryBiasedSampler,
    UniformSampler,
    WeightedSampler,
    choose_blocks,
    length_class,
)

BS = 16


def hit(n_blocks: int, prompt: int | None = None, first_id: int = 0) -> Hit:
    prompt = prompt if prompt is not None else n_blocks * BS + 5
    return Hit(list(range(prompt)), n_blocks * BS,
               {0: list(range(first_id, first_id + n_blocks))})


class Heavy(WeightedSampler):
    """Every third hit weighs 50: the budget must not move."""

    def __init__(self, every: int) -> None:
        super().__init__(every, seed=3)
        self.n = 0

    def weight(self, hit: Hit) -> float:
        self.n += 1
        return 50.0 if self.n % 3 == 0 else 1.0


@pytest.mark.parametrize("every", [1, 4, 25])
def test_weighted_sampling_spends_exactly_the_uniform_budget(every: int) -> None:
    for sampler in (Heavy(every), WeightedSampler(every), UniformSampler(every)):
        n = 10_000
        taken = sum(sampler.should_sample(hit(3)) for _ in range(n))
        assert n // every - 2 <= taken <= n // every + 2, type(sampler).__name__


def test_favoured_hits_are_sampled_first() -> None:
    sampler = Heavy(8)
    picks = [sampler.should_sample(hit(3)) for _ in range(3000)]
    heavy = sum(p for i, p in enumerate(picks, 1) if i % 3 == 0)
    assert heavy > 0.9 * sum(picks)  # the 1-in-3 heavy hits take nearly every sample


def test_boundary_biased_learns_boundary_blocks_from_cache_events() -> None:
    s = BoundaryBiasedSampler(every=8, block_size=BS, seed=0)
    ordinary, aligned = hit(4, first_id=0), hit(4, first_id=100)
    assert s.weight(ordinary) == s.weight(aligned) == 1.0
    assert s.weight(hit(4, prompt=5 * BS)) == s.boost  # prompt an exact block multiple
    # Sequence 7 stored blocks 100..103 and released them: its tail (103) was full, so its
    # length was a multiple of the block size. Sequence 8 ended inside block 3's successor.
    for i, b in enumerate((100, 101, 102, 103)):
        s.observe_store(StoredBlock(0, b, 1, list(range(BS)), i * BS, seq_id=7))
    s.observe_release(0, 7, (100, 101, 102, 103))
    for i, b in enumerate((0, 1, 2, 3)):
        s.observe_store(StoredBlock(0, b, 1, list(range(BS)), i * BS, seq_id=8))
    s.observe_release(0, 8, (0, 1, 2, 3, 4))  # block 4: a partial tail, never stored
    assert s.weight(aligned) == s.boost and s.weight(ordinary) == 1.0
    s.observe_free(0, (103,))  # evicted: no longer a boundary the index can serve
    assert s.weight(aligned) == 1.0


def test_boundary_biased_memory_is_bounded() -> None:
    s = BoundaryBiasedSampler(every=8, block_size=BS, memory=10)
    for b in range(1000):
        s.observe_store(StoredBlock(0, b, 1, list(range(BS)), 0, seq_id=b))
        s.observe_release(0, b, (b,))
    assert len(s._stored_by) <= 10 and len(s._boundary) <= 10


def test_boundary_biased_catches_a_rare_boundary_hit_sooner_at_equal_budget() -> None:
    """A stream where 1 hit in 10 ends on a boundary block: at 1-in-20, the uniform policy
    samples them at the base rate, the boundary-biased one almost always."""
    rng = random.Random(0)
    biased = BoundaryBiasedSampler(every=20, block_size=BS, seed=1)
    uniform = UniformSampler(every=20, seed=1)
    biased.observe_store(StoredBlock(0, 999, 1, list(range(BS)), 3 * BS, seq_id=1))
    biased.observe_release(0, 1, (996, 997, 998, 999))
    counts = {"biased": [0, 0], "uniform": [0, 0]}
    for _ in range(20_000):
        special = rng.random() < 0.1
        h = hit(4, first_id=996) if special else hit(4, first_id=0)
        for name, sampler in (("biased", biased), ("uniform", uniform)):
            if sampler.should_sample(h):
                counts[name][special] += 1
    assert abs(sum(counts["biased"]) - sum(counts["uniform"])) <= 3  # same budget
    assert counts["uniform"][1] < 0.2 * sum(counts["uniform"])
    assert counts["biased"][1] > 0.8 * sum(counts["biased"])


def test_adaptive_boosts_the_anomalous_class_for_a_window() -> None:
    s = AdaptiveSampler(every=10, seed=0, boost=8.0, window=50)
    short, long_ = hit(2), hit(40)
    assert length_class(short) != length_class(long_)
    assert s.weight(long_) == 1.0
    s.feedback(long_, anomalous=False)
    assert s.weight(long_) == 1.0
    s.feedback(long_, anomalous=True)
    assert s.weight(short) == 1.0  # other classes unchanged
    boosted = [s.weight(long_) for _ in range(60)]
    assert boosted[:50] == [8.0] * 50 and boosted[50:] == [1.0] * 10  # the window ends


def test_adaptive_samples_the_hot_class_more_without_spending_more() -> None:
    s = AdaptiveSampler(every=10, seed=0, window=10**6)
    u = UniformSampler(every=10, seed=0)
    s.feedback(hit(40), anomalous=True)
    hits = [hit(40) if i % 5 == 0 else hit(2) for i in range(5000)]
    taken = [h for h in hits if s.should_sample(h)]
    base = [h for h in hits if u.should_sample(h)]
    assert abs(len(taken) - len(base)) <= 2
    assert sum(len(h.blocks[0]) == 40 for h in taken) > 3 * sum(len(h.blocks[0]) == 40
                                                                 for h in base)


def test_random_block_baseline_does_not_always_take_the_last_block() -> None:
    h = hit(16)
    rng = random.Random(0)
    with_last = [choose_blocks(h, BS, 2, rng) for _ in range(200)]
    without = [choose_blocks(h, BS, 2, rng, last_block=False) for _ in range(200)]
    assert all(any(r.index == 15 for r in refs) for refs in with_last)
    assert sum(any(r.index == 15 for r in refs) for refs in without) < 60
    assert all(len({r.index for r in refs}) == 2 for refs in without)
    assert UniformSampler(4, last_block=False).choose(h, BS, 20)[-1].index == 15  # all of them


def test_policies_validate_their_knobs() -> None:
    with pytest.raises(ValueError):
        WeightedSampler(0)
    with pytest.raises(ValueError):
        BoundaryBiasedSampler(4, block_size=0)
    with pytest.raises(ValueError):
        AdaptiveSampler(4, boost=0.5)


def test_monitor_forwards_cache_events_to_a_learning_sampler():
    from sidecar.core.sampling import BoundaryBiasedSampler
    from tests.conftest import make_toy

    engine, _, mon = make_toy()
    seen: list[str] = []

    class Spy(BoundaryBiasedSampler):
        def observe_store(self, block):
            seen.append("store")
            super().observe_store(block)

        def observe_free(self, group_id, block_ids):
            seen.append("free")
            super().observe_free(group_id, block_ids)

        def observe_release(self, group_id, seq_id, block_ids):
            seen.append("release")
            super().observe_release(group_id, seq_id, block_ids)

    from sidecar.core.monitor import Monitor
    spy_mon = Monitor(mon.adapter, mon.config, sampler=Spy(every=1, block_size=4))
    engine.sink = spy_mon
    engine.serve(list(range(8)))
    spy_mon.on_free(0, [0])
    spy_mon.on_release(0, 1, [1])
    assert seen.count("store") == 2 and "free" in seen and "release" in seen
