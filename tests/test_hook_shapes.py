"""Issue 21: hostile shapes inside a hit or a hook's sequences are counted drops with a
reason, never a hook error or a traceback (the hook-object fuzz found ``'int' object is not
iterable`` from ``on_lookup``: a sampled hit's ``blocks`` of ``{0: 7}``)."""

from __future__ import annotations

import logging
import random

import pytest
from kvtestbed.bench.floods import good_lookup, reference
from kvtestbed.bench.fuzz_hits import (
    RaisingMapping,
    RaisingSequence,
    hostile_hit_lookup,
    hostile_sequence_call,
)

from sidecar import signals as S
from sidecar.core.hit_input import check_hit_shape, check_sampled_hit
from sidecar.core.protocol import Hit, Lookup, StoredBlock


@pytest.fixture(scope="module")
def sampled():  # type: ignore[no-untyped-def]
    # Verified inline: the verifier checks every id of a sampled hit (the engine's thread
    # only its shape and the ids it picks), so its count is there when the hook returns.
    engine, mon = reference(sample_every=1, dispatch="inline")
    good = good_lookup(engine)
    yield mon, good
    mon.stop()


def _rejected(mon, hook: str, reason: str) -> float:  # type: ignore[no-untyped-def]
    return mon.metrics.value(S.HOOK_INPUT_REJECTED.name, hook=hook, reason=reason)


def _hook_errors(mon) -> float:  # type: ignore[no-untyped-def]
    return mon.metrics.value_sum(S.HOOK_ERRORS.name)


def _hit(good: Lookup, **fields: object) -> Lookup:
    h = good.hit_tokens
    base: dict[str, object] = {"tokens": good.hit.tokens, "hit_tokens": h,
                               "blocks": {0: list(range(h // 4))},
                               "generations": {0: [1] * (h // 4)}}
    base.update(fields)
    return Lookup(good.query_tokens, h, Hit(**base))  # type: ignore[arg-type]


@pytest.mark.parametrize("fields, reason", [
    ({"blocks": {0: 7}}, "type"),  # the fuzz's traceback: 'int' object is not iterable
    ({"blocks": {0: "abcd"}}, "type"),
    ({"blocks": {0: [0, None, 2]}}, "type"),
    ({"blocks": {0: [0, -1]}}, "negative"),
    ({"blocks": {"0": [0]}}, "type"),
    ({"blocks": {0: [0], 1: [1]}}, "inconsistent"),  # a group the engine has not got
    ({"blocks": {0: RaisingSequence(4, "getitem")}}, "type"),
    ({"blocks": RaisingMapping({0: [0]})}, "type"),
    ({"generations": {0: 3.5}}, "type"),
    ({"key_fields": {None: "x"}}, "type"),
    ({"tier_states": {0: 5}}, "type"),
])
def test_sampled_hit_with_hostile_insides_is_a_counted_drop(sampled, caplog, fields,
                                                             reason) -> None:
    mon, good = sampled
    before, errors = _rejected(mon, "on_lookup", reason), _hook_errors(mon)
    with caplog.at_level(logging.ERROR):
        mon.on_lookup(_hit(good, **fields))
    assert _rejected(mon, "on_lookup", reason) == before + 1
    assert _hook_errors(mon) == errors
    assert not [r for r in caplog.records if r.exc_info]


def test_a_good_sampled_hit_passes_the_shape_check(sampled) -> None:
    mon, good = sampled
    assert check_sampled_hit(good.hit, mon.info.groups) is None
    assert check_sampled_hit(_hit(good, blocks={0: range(4)}).hit, mon.info.groups) is None
    assert check_hit_shape(good.hit, mon.info.groups) is None


def test_the_engine_thread_reads_no_id_it_does_not_pick(sampled) -> None:
    """The shape check is O(groups): a bad id in the middle of a hit passes it and is
    found by the full check, which the verifier runs; a bad id the sampler picks (the last
    block) is refused on the engine's thread and no sample is taken."""
    mon, good = sampled
    n = good.hit_tokens // 4
    middle = _hit(good, blocks={0: [0, None, *range(2, n)]}).hit
    assert check_hit_shape(middle, mon.info.groups) is None
    assert check_sampled_hit(middle, mon.info.groups) == S.InputReject.TYPE
    sampled_before = mon.metrics.value(S.SAMPLED.name)
    before = _rejected(mon, "on_lookup", "negative")
    last = good.hit_tokens // mon.info.block_size - 1  # the block the sampler always picks
    mon.on_lookup(_hit(good, blocks={0: [*range(last), -5, *range(last + 1, n)]}))
    assert _rejected(mon, "on_lookup", "negative") == before + 1
    assert mon.metrics.value(S.SAMPLED.name) == sampled_before


@pytest.mark.parametrize("call", [
    lambda m: m.on_store(StoredBlock(0, 1, 1, RaisingSequence(4, "len"), 0)),
    lambda m: m.on_free(0, RaisingSequence(4, "len")),
    lambda m: m.on_free(0, RaisingSequence(4, "iter")),
    lambda m: m.on_release(0, 1, RaisingSequence(4, "iter")),
    lambda m: m.on_allocate(0, 1, [1], RaisingSequence(1, "len")),
])
def test_sequences_that_raise_are_counted_type_drops(sampled, caplog, call) -> None:
    mon, _ = sampled
    errors = _hook_errors(mon)
    total = mon.metrics.value_sum(S.HOOK_INPUT_REJECTED.name)
    with caplog.at_level(logging.ERROR):
        call(mon)
        mon.journal.drain()
    assert mon.metrics.value_sum(S.HOOK_INPUT_REJECTED.name) == total + 1
    assert _hook_errors(mon) == errors
    assert not [r for r in caplog.records if r.exc_info]


def test_fuzzed_shapes_never_reach_a_hook_error(sampled, caplog) -> None:
    mon, good = sampled
    rng = random.Random(21)
    errors = _hook_errors(mon)
    with caplog.at_level(logging.ERROR):
        for _ in range(400):
            if rng.random() < 0.6:
                mon.on_lookup(hostile_hit_lookup(rng, good))
            else:
                hook, args = hostile_sequence_call(rng)
                arity = {"on_store": 1, "on_free": 2, "on_release": 3, "on_allocate": 4}[hook]
                getattr(mon, hook)(*args[:arity])
        mon.journal.drain()
    assert _hook_errors(mon) == errors
    assert not [r for r in caplog.records if r.exc_info]
