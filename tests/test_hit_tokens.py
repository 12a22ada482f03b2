"""Issue 21: a sampled hit's token ids that are not ints in range (bools, floats, huge ints,
strings, nested lists, too few, a sequence that raises) are a counted, logged drop
(``samples_dropped_total{reason="bad_tokens"}``), never hashed, recomputed or recorded: on
75d8333 ``True``/``1.0`` hashed like ``1`` and were verified as real tokens, ``"a"`` ended
in false ``token_mismatch`` anomalies and a traceback from the evidence record, ``[[1]]`` in a
hash ``TypeError`` counted as an adapter error."""

from __future__ import annotations

import logging
from collections import UserList
from dataclasses import replace

import pytest
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.bench.floods import good_lookup
from kvtestbed.bench.fuzz_hits import RaisingSequence, fuzz_hit_shapes
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.model import ModelConfig

from sidecar import signals as S
from sidecar.checks.keys import MAX_TOKEN_ID, token_ids_problem
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import Hit, Lookup

BAD = S.DropReason.BAD_TOKENS.value


@pytest.fixture(scope="module")
def inline():  # type: ignore[no-untyped-def]
    """A real monitor over the reference engine, verifying each sampled hit on the caller's
    thread (so a case's outcome is read right after its hook call)."""
    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype="float32", seed=0),
                                          num_blocks=128, kv_digest=True))
    mon = Monitor(ReferenceAdapter(engine), SidecarConfig(
        sample_every=1, dispatch="inline", adapter_timeout_s=30.0, recompute_tokens_per_s=0,
        allocator_check_min_interval_s=-1))
    engine.sink = mon
    good = good_lookup(engine)
    yield mon, good
    mon.stop()


def _with_tokens(good: Lookup, tokens: object) -> Lookup:
    return replace(good, hit=replace(good.hit, tokens=tokens))


def _counts(mon: Monitor) -> tuple[float, float, float, float]:
    m = mon.metrics
    return (m.value(S.SAMPLES_DROPPED.name, reason=BAD), m.value_sum(S.VERIFIED.name),
            m.value_sum(S.ANOMALIES.name), m.value_sum(S.HOOK_ERRORS.name))


def _hostile(good: Lookup, kind: str) -> object:
    tokens = list(good.hit.tokens)
    n = good.hit_tokens
    one = {"bool": True, "float": 1.0, "nan": float("nan"), "huge": 10**30,
           "past_int32": MAX_TOKEN_ID + 1, "negative": -1, "str": "7", "bytes": b"7",
           "none": None, "nested": [1], "tuple_id": (1,)}
    if kind in one:
        return [one[kind]] * len(tokens)
    if kind == "one_bad_inside":
        tokens[n // 2] = 2.5
        return tokens
    if kind == "too_few":
        return tokens[: n - 1]
    return RaisingSequence(len(tokens), kind.removeprefix("raising_"))


@pytest.mark.parametrize("kind", [
    "bool", "float", "nan", "huge", "past_int32", "negative", "str", "bytes", "none",
    "nested", "tuple_id", "one_bad_inside", "too_few", "raising_getitem", "raising_iter",
    "raising_len"])
def test_hostile_token_ids_are_a_counted_logged_drop(inline, caplog, kind) -> None:
    mon, good = inline
    bad, verified, anomalies, errors = _counts(mon)
    mon.verifier.bad_tokens = 0  # the next one is logged (1, 10, 100, ...)
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        mon.on_lookup(_with_tokens(good, _hostile(good, kind)))  # never raises
    assert _counts(mon) == (bad + 1, verified, anomalies, errors)
    assert [r for r in caplog.records if "bad_tokens" in r.getMessage()], "not logged"
    assert not [r for r in caplog.records if r.exc_info], "a traceback for bad input"


@pytest.mark.parametrize("tokens", [tuple, list, UserList])
def test_good_token_ids_of_any_sequence_type_are_verified(inline, tokens) -> None:
    mon, good = inline
    bad, verified, anomalies, _ = _counts(mon)
    mon.on_lookup(_with_tokens(good, tokens(good.hit.tokens)))
    after = _counts(mon)
    assert after[0] == bad and after[1] > verified and after[2] == anomalies


def test_tokens_past_the_hit_are_not_judged() -> None:
    """Only ``tokens[:hit_tokens]`` are read: the rest of the prompt is the engine's."""
    hit = Hit(tokens=[1, 2, 3, 4, "tail"], hit_tokens=4, blocks={0: [0]})
    assert token_ids_problem(hit, 4) is None
    assert token_ids_problem(replace(hit, hit_tokens=5), 4) is not None
    assert "needs 8" in (token_ids_problem(hit, 8) or "")


def test_the_bench_row_accounts_for_every_case() -> None:
    row = fuzz_hit_shapes(150, seed=3)
    assert row.cases == row.survived == 150 and row.escaped == row.lost == 0, row
    assert "dropped as bad_tokens" in row.tried and " 0 dropped as" not in row.tried, row
