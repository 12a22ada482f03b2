"""Hostile *shapes* for the hook-object fuzz of ``kv-sidecar bench reliability``: hits whose
counts are valid (so they pass the O(1) door and reach the sampled path) but whose insides
are not, and objects whose own ``__len__``/``__iter__``/``__getitem__`` raise or lie.

:func:`kvtestbed.bench.fuzz.hostile_hook_call` swaps whole fields for hostile values; those
mostly stop at the door. These go one level deeper: the group maps, the id lists and the
ids themselves, where the sampled path walks a hit on the engine's thread.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kvtestbed.bench.fuzz import FuzzResult, hostile_values
from sidecar import signals as S


class RaisingSequence(Sequence[int]):
    """A sequence whose methods raise (or whose length lies): a broken engine object."""

    def __init__(self, n: int, fail: str) -> None:
        self.n, self.fail = n, fail

    def __len__(self) -> int:
        if self.fail == "len":
            raise RuntimeError("hostile __len__")
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if self.fail in ("getitem", "iter"):
            raise IndexError("hostile __getitem__") if self.fail == "getitem" \
                else RuntimeError("hostile __getitem__")
        return 1

    def __iter__(self) -> Iterator[int]:
        if self.fail == "iter":
            raise RuntimeError("hostile __iter__")
        return iter([1] * min(self.n, 64)) if self.fail != "short" else iter(())


class RaisingMapping(dict[Any, Any]):
    """A dict whose ``items``/``keys``/``get`` raise: passes ``isinstance(x, Mapping)``."""

    def items(self) -> Any:
        raise RuntimeError("hostile items()")

    def get(self, *a: Any) -> Any:
        raise RuntimeError("hostile get()")

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("hostile __iter__")


def _ids(rng: random.Random, n: int) -> Any:
    """A group's block ids: valid, or hostile as a whole, or one hostile id inside."""
    r = rng.random()
    if r < 0.3:
        return list(range(n))
    if r < 0.5:
        return hostile_values(rng)
    if r < 0.65:
        ids: list[Any] = list(range(n))
        if ids:
            ids[rng.randrange(len(ids))] = hostile_values(rng)
        return ids
    if r < 0.8:
        return RaisingSequence(n, rng.choice(("len", "getitem", "iter", "short")))
    return rng.choice((str(n), b"\x00" * n, range(n), tuple(range(n)), {1: 2}, {1, 2}))


def _group_map(rng: random.Random, n: int) -> Any:
    r = rng.random()
    if r < 0.15:
        return hostile_values(rng)
    if r < 0.25:
        return RaisingMapping({0: list(range(n))})
    key = rng.choice((0, 0, 0, 1, -1, 2**40, "0", None, 0.5, (0,), True))
    out = {key: _ids(rng, n)}
    if rng.random() < 0.2:
        out[rng.choice((1, "x", 3.0))] = _ids(rng, n)
    return out


def hostile_tokens(rng: random.Random, tokens: Sequence[int]) -> Any:
    """A hit's token ids as a broken integration hands them over: all of one wrong type, one
    wrong id among good ones, too few, or a sequence that raises."""
    bad: list[Callable[[], Any]] = [
        lambda: True, lambda: 1.0, lambda: float("nan"), lambda: 2**64, lambda: -1,
        lambda: 10**400, lambda: "7", lambda: b"7", lambda: None, lambda: [1], lambda: (1,),
        lambda: [[1, 2]], lambda: hostile_values(rng)]
    n, r = len(tokens), rng.random()
    if r < 0.3:
        return [rng.choice(bad)()] * n
    if r < 0.7:
        out: list[Any] = list(tokens) or [0]
        out[rng.randrange(len(out))] = rng.choice(bad)()
        return out
    if r < 0.8:
        return list(tokens[:rng.randrange(n)]) if n else []
    if r < 0.9:
        return RaisingSequence(n, rng.choice(("len", "getitem", "iter")))
    return rng.choice((hostile_values(rng), tuple(tokens), range(n), list(tokens)))


def hostile_hit_lookup(rng: random.Random, good: Any) -> Any:
    """A Lookup with the good one's counts and a hit whose insides are hostile."""
    from sidecar.core.protocol import Hit, Lookup

    h = good.hit_tokens
    n = max(1, h // 4)
    fields: dict[str, Any] = {
        "tokens": good.hit.tokens if good.hit is not None else list(range(h)),
        "hit_tokens": h, "blocks": {0: list(range(n))}, "generations": {0: [1] * n}}
    pick = rng.choice(("blocks", "generations", "key_fields", "tier_states", "tokens",
                       "blocks", "blocks", "hit_tokens"))
    if pick in ("blocks", "generations"):
        fields[pick] = _group_map(rng, n)
    elif pick in ("key_fields", "tier_states"):
        fields[pick] = rng.choice((hostile_values(rng), RaisingMapping({"a": "b"}),
                                   {None: "x"}, {0: 5}, {"a": hostile_values(rng)}))
    elif pick == "tokens":
        fields[pick] = hostile_tokens(rng, fields["tokens"])
    else:
        fields[pick] = rng.choice((hostile_values(rng), h + 1, -1))
    return Lookup(good.query_tokens, h, Hit(**fields), seq_id=rng.choice((None, 1, "s")))


def hostile_sequence_call(rng: random.Random) -> tuple[str, tuple[Any, ...]]:
    """A store/free/allocate/release call whose sequences are broken objects."""
    from sidecar.core.protocol import StoredBlock

    seq: Callable[[], Any] = lambda: _ids(rng, rng.randint(0, 8))  # noqa: E731
    hook = rng.choice(("on_store", "on_free", "on_release", "on_allocate"))
    if hook == "on_store":
        return hook, (StoredBlock(0, rng.randint(0, 64), 1, seq(), 0),)
    return hook, (0, rng.randint(0, 64), seq(), seq()) if hook != "on_free" else \
        (0, seq(), None, None)


def _token_ids_ok(tokens: Any, hit_tokens: int) -> bool:
    """The bench's own oracle (not the sidecar's check): the protocol's token ids."""
    return type(tokens) in (list, tuple, range) and len(tokens) >= hit_tokens and all(
        type(t) is int and 0 <= t < 2**31 for t in tokens[:hit_tokens])


def fuzz_hit_shapes(n: int, seed: int = 0) -> FuzzResult:
    """Sampled hits with hostile insides (:func:`hostile_hit_lookup`: token ids, group maps,
    block ids) into ``on_lookup`` of a real Monitor over the reference engine, verified
    inline (on this thread), so every case is accounted for on its own: refused at the
    hook with a reason, or sampled and then verified or dropped with a reason. A case that
    moved none of those, or a hook error, is lost; an exception out of the hook escaped."""
    from kvtestbed.adapters.paged_adapter import ReferenceAdapter
    from kvtestbed.bench.floods import good_lookup
    from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
    from kvtestbed.engines.model import ModelConfig
    from sidecar.core.monitor import Monitor, SidecarConfig

    engine = ReferenceEngine(EngineConfig(model=ModelConfig(dtype="float32", seed=0),
                                          num_blocks=128, kv_digest=True))
    mon = Monitor(ReferenceAdapter(engine), SidecarConfig(
        sample_every=1, dispatch="inline", adapter_timeout_s=5.0, recompute_tokens_per_s=0,
        allocator_check_min_interval_s=-1))
    engine.sink = mon
    good = good_lookup(engine)
    m, rng = mon.metrics, random.Random(seed)
    outcome = {"refused": 0, "verified": 0, "dropped": 0, "unsampled": 0}
    bad_tokens = S.DropReason.BAD_TOKENS.value

    def tally() -> tuple[float, ...]:
        return (m.value_sum(S.HOOK_INPUT_REJECTED.name), m.value(S.SAMPLED.name),
                m.value_sum(S.VERIFIED.name), m.value_sum(S.SAMPLES_DROPPED.name),
                m.value(S.SAMPLES_DROPPED.name, reason=bad_tokens),
                m.value(S.HITS.name), m.value_sum(S.HOOK_ERRORS.name))

    res = FuzzResult("hit_shapes", "sampled hits with hostile token ids (bool, float, huge, "
                                   "str, nested, too few, raising), group maps and block ids "
                                   "-> on_lookup -> a real verifier (inline)")
    for _ in range(n):
        if rng.random() < 0.5:
            lookup = hostile_hit_lookup(rng, good)
        else:  # the hit as the engine handed it over, but for its token ids
            lookup = replace(good, hit=replace(good.hit, tokens=hostile_tokens(
                rng, good.hit.tokens)))
        tokens_ok = _token_ids_ok(lookup.hit.tokens, good.hit_tokens)
        before = tally()
        res.cases += 1
        try:
            mon.on_lookup(lookup)
            res.survived += 1
        except Exception:
            res.escaped += 1
            continue
        refused, sampled, verified, dropped, as_bad, hits, errors = (
            a - b for a, b in zip(tally(), before, strict=True))
        if errors or (sampled and bool(as_bad) == tokens_ok):
            # a hook error, garbage token ids verified, or good ones dropped as bad_tokens
            res.lost += 1
        elif refused:
            outcome["refused"] += 1
        elif sampled and (verified or dropped):
            outcome["verified" if verified else "dropped"] += 1
        elif hits and not sampled:  # the sampler chose no block to check
            outcome["unsampled"] += 1
        else:
            res.lost += 1
    mon.stop()
    res.tried += (" (" + ", ".join(f"{k} {v}" for k, v in outcome.items())
                  + f"; {m.value(S.SAMPLES_DROPPED.name, reason=bad_tokens):g} dropped as "
                  f"{bad_tokens})")
    return res
