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
from typing import Any

from kvtestbed.bench.fuzz import hostile_values


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
        fields[pick] = rng.choice((hostile_values(rng), RaisingSequence(h, "len"),
                                   RaisingSequence(h, "iter"), [None] * h))
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
