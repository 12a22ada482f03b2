"""sidecar.allocator.invariants proves a healthy pool at C speed and walks only the blocks
that could break an invariant: checked here against the walk over every block it replaced
(kept below as the oracle), on seeded random pools, healthy and broken in every way the
checks know, so a skipped block can never hide a violation or change a message."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from sidecar.allocator.invariants import Violation, check_snapshot, unheld_references
from sidecar.core.protocol import BlockTableSnapshot
from sidecar.signals import InvariantKind as K

MUTATIONS = ("none", "free_held", "double_list", "both_lists", "stale", "free_indexed",
             "rc_low", "rc_high", "rc_negative", "lost", "cached_unindexed", "out_of_range",
             "table_out_of_range", "index_out_of_range", "reserved_odd")


def _pool(rng: random.Random, mutation: str) -> BlockTableSnapshot:
    n = rng.randint(1, 300)
    ids = list(range(n))
    rng.shuffle(ids)
    held_part = ids[:rng.randint(0, n)]
    rest = ids[len(held_part):]
    cut = rng.randint(0, len(rest))
    free, cached = rest[:cut], rest[cut:]
    sequences: dict[object, list[int]] = {}
    ref = [0] * n
    for b in held_part:  # each held block in one to three live tables
        for _ in range(rng.randint(1, 3)):
            seq = rng.randint(0, max(1, n // 4))
            sequences.setdefault(seq, []).append(b)
            ref[b] += 1
    hashes: list[object] = [None] * n
    index: list[tuple[object, int]] = []
    for b in cached + [b for b in held_part if rng.random() < 0.5]:
        hashes[b] = ("h", b)
        index.append((("h", b), b))
    reserved: list[int] = []
    if mutation != "none" and n > 1:
        b = rng.randrange(n)
        if mutation == "free_held" and held_part:
            free.append(rng.choice(held_part))
        elif mutation == "double_list" and free:
            free.append(free[0])
        elif mutation == "both_lists" and free:
            cached.append(free[0])
        elif mutation == "stale" and index:
            _, b = index[0]
            hashes[b] = ("other", b)
        elif mutation == "free_indexed" and free:
            index.append((("x", free[0]), free[0]))
            hashes[free[0]] = ("x", free[0])
        elif mutation == "rc_low" and held_part:
            ref[held_part[0]] -= 1
        elif mutation == "rc_high":
            ref[b] += 1
        elif mutation == "rc_negative":
            ref[b] = -1
        elif mutation == "lost" and free:
            free.pop()
        elif mutation == "cached_unindexed" and cached:
            index = [e for e in index if e[1] != cached[0]]
        elif mutation == "out_of_range":
            free.append(n + 3)
        elif mutation == "table_out_of_range":
            sequences.setdefault("bad", []).append(-1)
        elif mutation == "index_out_of_range":
            index.append((("y", n), n + 1))
        elif mutation == "reserved_odd":
            ref[b] += 5  # broken, but reserved: skipped
            reserved.append(b)
    return BlockTableSnapshot(
        group_id=rng.randint(0, 2), num_blocks=n, free=tuple(free), cached=tuple(cached),
        ref_counts=tuple(ref), block_hashes=tuple(hashes), index=tuple(index),
        sequences={k: tuple(v) for k, v in sequences.items()},
        generations=tuple(rng.randint(0, 9) for _ in range(n)), reserved=tuple(reserved))


def _canonical(found: list[Violation]) -> list[tuple[object, ...]]:
    """Same violations, same messages; both-lists messages came from set order before."""
    return sorted((v.kind.value, v.group_id, v.block_id, v.detail, v.generation)
                  for v in found)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_fast_check_finds_exactly_what_walking_every_block_found(mutation: str) -> None:
    rng = random.Random(mutation)
    broken = 0
    for _ in range(150):
        snap = _pool(rng, mutation)
        expected = _walk_every_block(snap)
        assert _canonical(check_snapshot(snap)) == _canonical(expected)
        assert unheld_references(snap) == _unheld_walk(snap)
        broken += bool(expected)
    if mutation in ("none", "reserved_odd"):
        assert broken == 0
    else:
        assert broken > 0  # the mutation did break pools: the comparison was not vacuous



class _FalsyInt(int):
    def __bool__(self) -> bool:
        return False


class _EqRaises:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no __eq__")

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


def _odd(**fields: object) -> BlockTableSnapshot:
    base: dict[str, object] = dict(group_id=0, num_blocks=3, free=(0, 1), cached=(),
                                   ref_counts=(0, 0, 1), block_hashes=(None,) * 3,
                                   index=(), sequences={"a": (2,)})
    return BlockTableSnapshot(**{**base, **fields})  # type: ignore[arg-type]


def test_odd_but_readable_inputs_are_judged_as_the_walk_judged_them() -> None:
    """An outside fuzzer's finds: a numpy array of ref counts, a float or bool id, a ref
    count that is falsy but not 0, a hash whose __eq__ raises: never a crash where the walk
    gave an answer, and the same answer (ids reported as the pool's own ints)."""
    np = pytest.importorskip("numpy")
    cases = [
        _odd(ref_counts=np.array([0, 0, 1])),
        _odd(free=(0, 1.0)),
        _odd(free=(0, 1, float("nan"))),  # min/max let a NaN by: ids are looked up
        _odd(sequences={"a": (2, float("nan"))}),
        _odd(free=(1,), cached=(False,)),
        _odd(free=(2, 1), ref_counts=(0, 0, _FalsyInt(2)), sequences={}),
        _odd(free=(0,), cached=(1,), block_hashes=(None, _EqRaises(), _EqRaises()),
             index=((_EqRaises(), 1), (_EqRaises(), 2))),
    ]
    for snap in cases:
        got = _canonical(check_snapshot(snap))
        assert got == _canonical(_walk_every_block(snap)), snap
        assert all(type(v[2]) is int or v[2] is None for v in got)


def test_a_hash_is_the_same_hash_as_itself_however_many_entries() -> None:
    """A NaN (unequal to itself) held by the block and its entry: the very object, so not
    stale, with one entry as with several (the walk said 'stale' for it)."""
    nan = float("nan")
    one = _odd(free=(0,), cached=(1,), block_hashes=(None, nan, None), index=((nan, 1),))
    two = _odd(free=(0,), cached=(1,), block_hashes=(None, nan, nan),
               index=((nan, 1), (nan, 2)))
    assert check_snapshot(one) == [] and check_snapshot(two) == []
    other = _odd(free=(0,), cached=(1,), block_hashes=(None, float("nan"), None),
                 index=((float("nan"), 1),))
    assert [v.kind for v in check_snapshot(other)] == [K.STALE_INDEX]

    class Liar:  # == says yes, != says yes too: judged by == whatever the entry count
        def __eq__(self, o: object) -> bool:
            return True

        def __ne__(self, o: object) -> bool:
            return True

        __hash__ = object.__hash__

    for entries in (1, 2):
        snap = _odd(free=(0,), cached=(1,), ref_counts=(0, 0, 1),
                    block_hashes=(None, Liar(), Liar() if entries == 2 else None),
                    index=tuple((Liar(), b) for b in (1, 2)[:entries]))
        assert check_snapshot(snap) == [], entries

# ---------------------------------------------------------------- the oracle: every block walked
def _walk_every_block(snap: BlockTableSnapshot) -> list[Violation]:
    """Every broken invariant of one group's block pool (empty when healthy)."""
    n = snap.num_blocks
    g = snap.group_id
    out: list[Violation] = []
    gens = snap.generations if len(snap.generations) == n else (0,) * n
    reserved = frozenset(snap.reserved)

    def add(kind: K, block: int | None, detail: str) -> None:
        gen = gens[block] if block is not None and 0 <= block < n else 0
        out.append(Violation(kind, g, block, detail, gen))

    if len(snap.ref_counts) != n or len(snap.block_hashes) != n:
        add(K.BLOCK_COUNT_MISMATCH, None,
            f"{len(snap.ref_counts)} ref counts / {len(snap.block_hashes)} hashes for "
            f"{n} blocks")
        return out

    # Holders, from the live block tables (what the model reads through).
    held = [0] * n
    who: dict[int, object] = {}
    for seq, table in snap.sequences.items():
        for b in table:
            if 0 <= b < n:
                held[b] += 1
                who[b] = seq
            else:
                add(K.BLOCK_COUNT_MISMATCH, None, f"sequence {seq} names block {b}, "
                    f"outside the pool of {n}")

    free_count = Counter(snap.free)
    cached_count = Counter(snap.cached)
    for listed in (free_count, cached_count):
        for b, c in listed.items():
            if not 0 <= b < n:
                add(K.BLOCK_COUNT_MISMATCH, None, f"block {b} on a free list, outside the pool")
            elif c > 1:
                add(K.DOUBLE_FREE, b, f"block {b} is on a free list {c} times")
    for b in free_count.keys() & cached_count.keys():
        if 0 <= b < n:
            add(K.BLOCK_COUNT_MISMATCH, b, f"block {b} is both free and evictable")

    indexed: Counter[int] = Counter()
    for h, b in snap.index:
        if not 0 <= b < n:
            add(K.BLOCK_COUNT_MISMATCH, None, f"a hash-map entry names block {b}, outside "
                "the pool")
            continue
        indexed[b] += 1
        if snap.block_hashes[b] != h:
            add(K.STALE_INDEX, b, f"a hash-map entry names block {b}, which now holds other "
                "content (reallocated while indexed)")

    ref_counts = snap.ref_counts
    for b in range(n):
        if b in reserved:
            continue
        rc = ref_counts[b]
        h = held[b]
        on_free = b in free_count
        on_list = on_free or b in cached_count
        if rc < 0:
            add(K.DOUBLE_FREE, b, f"block {b} has ref count {rc}: released more often "
                "than taken")
        elif on_list and (rc > 0 or h > 0):
            holder = f" (sequence {who.get(b)})" if h else ""
            add(K.FREE_WHILE_HELD, b, f"block {b} is {'free' if on_free else 'evictable'} "
                f"with ref count {rc} and {h} live holder(s){holder}")
        elif rc < h:
            add(K.REF_COUNT_BELOW_HOLDERS, b, f"block {b}: ref count {rc} < {h} live "
                f"holders (sequence {who.get(b)}): freed while still in use")
        elif rc > h:
            add(K.LEAKED_REFERENCE, b, f"block {b}: ref count {rc} > {h} live holders: "
                "a reference no live sequence holds")
        if on_free and indexed[b]:
            add(K.FREE_WHILE_INDEXED, b, f"block {b} is free but the hash map still names it")
        if not on_list and rc == 0 and h == 0:
            add(K.BLOCK_COUNT_MISMATCH, b, f"block {b} is unreferenced but on no free list "
                "(lost)")
        if b in cached_count and not indexed[b]:
            add(K.BLOCK_COUNT_MISMATCH, b, f"block {b} is evictable but no hash-map entry "
                "names it")
    return out



def _unheld_walk(snap: BlockTableSnapshot) -> int:
    """References the allocator counts that no live sequence holds: the sum over blocks of
    ref count minus live block-table references, where positive. What the leak trend test
    watches: a leaked reference never comes back, so this only grows under a leak, while a
    count of *blocks* held by nobody dips whenever a live sequence hits a leaked (still
    indexed) block."""
    held = [0] * snap.num_blocks
    for table in snap.sequences.values():
        for b in table:
            if 0 <= b < snap.num_blocks:
                held[b] += 1
    reserved = frozenset(snap.reserved)
    return sum(rc - h for b, (rc, h) in enumerate(zip(snap.ref_counts, held, strict=False))
               if rc > h and b not in reserved)
