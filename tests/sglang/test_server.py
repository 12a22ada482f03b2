"""A real SGLang 0.5.23 server with kv-sidecar's radix-cache backend, verified end to end.

Per dtype (float32, bfloat16), on one server each (tests/sglang/conftest.py), in order:
clean traffic with shared prefixes is quiet (every sampled block verified against the HF
recompute, no finding, no invariant violation, SGLang's hit count equal to the tap's);
eviction pressure keeps the slot invariants clean; then faults injected into SGLang's real
pool and tree (tests/sglang/fault_backend.py) are each caught and named. The premature
free runs last: it leaves the tree owning reused slots.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from sidecar import signals as S
from sidecar.signals import AnomalyKind as A
from sidecar.signals import InvariantKind as K
from tests.sglang.conftest import MEASUREMENTS, Stack, clean_traffic, dropped
from tests.sglang.harness import BLOCK, MAX_TOTAL_TOKENS, Workload

pytestmark = pytest.mark.sglang

# 5 prefixes (2..11 blocks, up to 8 checked) x 38 rounds: >= 1,000 verified blocks per dtype
CLEAN_ROUNDS = int(os.environ.get("KVSIDECAR_SGLANG_CLEAN_ROUNDS", "38"))
TRIALS = int(os.environ.get("KVSIDECAR_SGLANG_TRIALS", "5"))  # per fault, dtype: 5 of 5 = 0.9+


def _violations(stack: Stack) -> dict[str, float]:
    m = stack.sidecar.metrics
    return {k.value: m.value(S.INVARIANT_VIOLATIONS.name, kind=k.value) for k in K}


def _verify(stack: Stack) -> list:
    return stack.sidecar.verify_pending()


def test_clean_traffic_is_quiet(stack: Stack) -> None:
    srv, sc = stack.server, stack.sidecar
    w = Workload(seed=1, lengths=(40, 70, 100, 130, 180))
    verdicts = clean_traffic(stack, w, CLEAN_ROUNDS)
    hits = (CLEAN_ROUNDS - 1) * len(w.prefixes)  # every request after the first round
    # Every sampled hit is verified or counted as dropped (under load the tap's pipe drops
    # captures its queue cannot hold: a fresh clone beside two CPU hogs dropped 6 of 185);
    # then clean traffic goes on, at most 8 more rounds, until 1,000 blocks were verified.
    lost = dropped(stack)
    MEASUREMENTS[f"{stack.dtype} clean sampled hits dropped"] = lost
    assert len(verdicts) + lost == hits and lost <= hits // 10
    assert stack.sidecar.metrics.value_sum(S.HOOK_INPUT_REJECTED.name) == 0
    for _ in range(8 if CLEAN_ROUNDS >= 38 else 0):
        if sum(len(v.verified) for v in verdicts) >= 1000:
            break
        for tokens in w.round():
            srv.generate(tokens)
        verdicts += _verify(stack)
    verified = sum(len(v.verified) for v in verdicts)
    findings = [(f.kind.value, f.detail) for v in verdicts for f in v.findings]
    errors = [e for v in verdicts for _, e in v.errors]
    MEASUREMENTS[f"{stack.dtype} clean verified blocks"] = verified
    MEASUREMENTS[f"{stack.dtype} clean max recompute error"] = f"{max(errors):.3g}"
    assert findings == []
    assert verified >= 1000 or CLEAN_ROUNDS < 38  # (a shorter run was asked for)
    assert all(not v.dropped and not v.adapter_errors for v in verdicts)
    assert sc.receiver.bad_messages == 0 and sc.engine_mismatches == []
    assert sc.census_checks > 0 and sc.adapter.census is not None
    assert sum(_violations(stack).values()) == 0
    # SGLang's own hit count (its counter; the gauge is per batch) matches the tap's
    deadline = time.monotonic() + 60
    audit = sc.adapter.bridge.poll()
    while audit["cached_tokens"] != audit["counted_hit_tokens"] and \
            time.monotonic() < deadline:  # SGLang counts a request's hits when it finishes
        time.sleep(0.5)
        audit = sc.adapter.bridge.poll()
    MEASUREMENTS[f"{stack.dtype} hit audit"] = audit
    assert audit["cached_tokens"] == audit["counted_hit_tokens"] > 0


def test_invariants_clean_under_eviction(stack: Stack) -> None:
    srv, sc = stack.server, stack.sidecar
    rng = random.Random(7)
    before, freed = sc.census_checks, sc.freed_blocks
    sent = 0
    while sent < 2 * MAX_TOTAL_TOKENS:  # twice the pool: the tree must evict
        n = rng.randrange(120, 260)
        srv.generate([rng.randrange(3, 500) for _ in range(n)])
        sent += n
    srv.generate([5, 6, 7])
    sc.quiesce()
    verdicts = _verify(stack)
    assert [f.kind for v in verdicts for f in v.findings] == []
    assert sc.census_checks > before
    assert sc.freed_blocks > freed  # the tree evicted stored blocks
    census = sc.adapter.census
    assert census is not None and census.total == MAX_TOTAL_TOKENS
    MEASUREMENTS[f"{stack.dtype} census checks"] = sc.census_checks
    assert sum(_violations(stack).values()) == 0


def _trial(stack: Stack, op: str, rng: random.Random, **kw: object) -> set[str]:
    """Store a fresh prefix, inject ``op`` on it, hit it; the kinds the hit's verdict names."""
    srv = stack.server
    prefix = [rng.randrange(3, 500) for _ in range(5 * BLOCK)]
    extra = kw.pop("extra_key", None)
    srv.generate(prefix + [rng.randrange(3, 500) for _ in range(5)])
    _verify(stack)  # the store's own sample (a miss: none) is out of the way
    if op in ("stale", "reuse"):
        source = [rng.randrange(3, 500) for _ in range(5 * BLOCK)]
        srv.generate(source + [7])
        srv.fault(op, tokens=prefix, source=source)
    elif op == "drop_extra_key":
        srv.fault("drop_extra_key", on=True)
    else:
        srv.fault(op, tokens=prefix)
    srv.generate(prefix + [rng.randrange(3, 500) for _ in range(5)], extra_key=extra)
    if op == "drop_extra_key":
        srv.fault("drop_extra_key", on=False)
    kinds: set[str] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the hit's capture crosses a socket and a thread
        mine = [v for v in _verify(stack) if list(v.sample.hit.tokens[:BLOCK]) == prefix[:BLOCK]]
        for v in mine:
            kinds |= {f.kind.value for f in v.findings}
        if mine:
            break
    return kinds


@pytest.mark.parametrize(("op", "expected", "extra"), [
    ("zero", {A.ZEROS}, {}),
    ("stale", {A.RECOMPUTE_MISMATCH}, {}),
    ("drop_extra_key", {A.KEY_FIELDS_MISMATCH}, {"extra_key": "tenant-b"}),
    ("reuse", {A.RECOMPUTE_MISMATCH}, {}),
])
def test_fault_caught_and_named(stack: Stack, op: str, expected: set[str],
                                extra: dict[str, str]) -> None:
    rng = random.Random(hash((op, stack.dtype)) & 0xFFFF)
    caught = 0
    seen: list[set[str]] = []
    for _ in range(TRIALS):
        kinds = _trial(stack, op, rng, **extra)
        seen.append(kinds)
        caught += bool(kinds & {str(e) for e in expected})
    recall = caught / TRIALS
    MEASUREMENTS[f"{stack.dtype} {op} recall"] = f"{recall:.2f} {seen[:3]}"
    assert recall >= 0.9, seen


def test_premature_free_seen_by_the_census(stack: Stack) -> None:
    """Last on each server: SGLang itself exits on the negative usage this leaves."""
    srv, sc = stack.server, stack.sidecar
    prefix = [random.Random(11).randrange(3, 500) for _ in range(5 * BLOCK)]
    srv.generate(prefix + [9])
    assert _violations(stack)[K.FREE_WHILE_INDEXED.value] == 0
    freed = srv.fault("free", tokens=prefix)["slots"]

    def named_slots() -> set[int]:
        return {v["block_id"] for e in sc.monitor.evidence.recent(100)
                if e.get("type") == "invariant_violation" for v in e["violations"]
                if v["kind"] == K.FREE_WHILE_INDEXED.value}

    # The counter and the evidence record are written one after the other by another
    # thread: wait for both, not only the first.
    deadline = time.monotonic() + 120
    while (_violations(stack)[K.FREE_WHILE_INDEXED.value] == 0 or not named_slots()) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    v = _violations(stack)
    MEASUREMENTS[f"{stack.dtype} premature free violations"] = v
    assert v[K.FREE_WHILE_INDEXED.value] >= 1, v
    named = named_slots()
    assert named and named <= set(freed)  # the evidence names the freed slots
