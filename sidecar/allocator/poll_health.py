"""Allocator health: each poll's allocator state and block tables turned into signals.

:class:`AllocatorHealth` is what :meth:`sidecar.core.monitor.Monitor.poll_allocator` hands a poll
to. Per poll it

* runs the invariant checks (:mod:`.invariants`) on every block-table snapshot, counts each
  *new* violation once under its kind (``kvsidecar_invariant_violations_total{kind}``; a
  violation that persists across polls is one violation, a block breaking it again after
  being reallocated is another), and logs and records evidence for it with the block id,
  its generation and the block's lifecycle path (:mod:`.lifecycle`), never in a label;
* feeds the leak trend test (:mod:`.leak`) and publishes its gauges;
* audits the engine's own hit counter against the hits the sidecar counted
  (:mod:`.hit_counter`), where the adapter reports it;
* keeps the run's peaks (usage, fragmentation) and the request index of the first
  violation and the first leak suspicion, for the demo's summary.

Not thread-safe on its own: the Monitor serialises polls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sidecar import signals as S
from sidecar.allocator.hit_counter import HitCounterAudit
from sidecar.allocator.invariants import Violation, check_counts, check_snapshot, unheld_references
from sidecar.allocator.leak import LeakTrend, unheld_from_state
from sidecar.allocator.lifecycle import LifecycleLog
from sidecar.core.protocol import AllocatorState, BlockRef, BlockTableSnapshot
from sidecar.evidence.record import EvidenceLog
from sidecar.export.metrics import (
    Metrics,
    fragmentation_ratio,
    internal_fragmentation_ratio,
    usage_ratio,
)
from sidecar.signals import THRESHOLDS, InvariantKind

log = logging.getLogger(__name__)

LOGGED_PER_POLL = 8  # warning lines per poll; the rest are summarised (a leak floods)
EVIDENCE_VIOLATIONS = 32  # violations kept in one evidence record
EVIDENCE_PATHS = 8  # blocks whose lifecycle path goes into the evidence
PATH_EVENTS = 32  # lifecycle events kept per block


def allocation_failure_rate(state: AllocatorState | None) -> float:
    """Failed / attempted allocations since the engine started (PromQL takes the rate of
    the two counters instead; this is the run's total for summaries)."""
    if state is None or not state.allocations or state.allocation_failures is None:
        return 0.0
    return state.allocation_failures / state.allocations


def _last_op(event: dict[str, Any], block_id: int | None) -> str:
    """``last op free by seq 22``, with the block's generation where the event has it."""
    text = f"last op {event['op']} by seq {event['seq']}"
    blocks, gens = event["blocks"], event["generations"]
    if gens and block_id in blocks:
        text += f" (generation {gens[blocks.index(block_id)]})"
    return text


def _where(v: Violation) -> tuple[str, int, int | None]:
    return v.kind.value, v.group_id, v.block_id


def _confirmed(tables: Sequence[BlockTableSnapshot], found: list[Violation],
               retake: Callable[[], Sequence[BlockTableSnapshot] | None]
               ) -> tuple[Sequence[BlockTableSnapshot], list[Violation]]:
    """The second snapshot and the violations both snapshots show; none when it cannot be
    taken (the next poll checks again)."""
    again = retake()
    if again is None:
        return tables, []
    first = {_where(v) for v in found}
    return again, [v for snap in again for v in check_snapshot(snap) if _where(v) in first]


class AllocatorHealth:
    def __init__(self, metrics: Metrics, evidence: EvidenceLog, lifecycle: LifecycleLog,
                 leak: LeakTrend, engine: str = "", model: str = "",
                 counted_hit_tokens: Callable[[], float] | None = None) -> None:
        self.metrics = metrics
        # The sidecar's own count of hit tokens (the Monitor's cell), for the audit.
        self.counted_hit_tokens = counted_hit_tokens
        self.hit_counter = HitCounterAudit()
        self.evidence = evidence
        self.lifecycle = lifecycle
        self.leak = leak
        self.engine, self.model = engine, model
        # Violations seen at the previous poll, per source ("state", "tables"): a source
        # that could not be read this time keeps its set, so nothing is counted twice.
        self._active: dict[str, set[tuple[str, int, int | None, int, str]]] = {}
        self._double_frees: dict[int, int] = {}
        self.checks = 0
        self.first_violation_request: int | None = None
        self.first_leak_request: int | None = None
        self.max_usage_ratio = 0.0
        self.max_fragmentation_ratio = 0.0
        for kind in InvariantKind:
            metrics.inc(S.INVARIANT_VIOLATIONS, 0, kind=kind.value)
        metrics.inc(S.INVARIANT_CHECKS, 0)
        metrics.gauge(S.LEAK_SUSPECTED).set(0)
        metrics.gauge(S.LEAK_SUSPECTED_FLAG).set(0)

    # ------------------------------------------------------------------ polls
    def observe(self, state: AllocatorState | None,
                tables: Sequence[BlockTableSnapshot] | None, request_index: int,
                snapshot_seconds: float = 0.0,
                retake: Callable[[], Sequence[BlockTableSnapshot] | None] | None = None,
                ) -> list[Violation]:
        """One poll: ``tables`` is ``None`` where the adapter offers no block tables
        (``snapshot_seconds``: what taking them cost). Returns the violations first seen
        at this poll. With ``retake`` (the poller's), a violation in ``tables`` counts only
        when a second snapshot shows it again (same kind, group and block): an engine that
        changes ref counts under its lock but calls its hooks after releasing it leaves a
        snapshot between the two, which must not read as a leak."""
        new: list[Violation] = []
        unheld: int | None = None
        if state is not None:
            usage, frag = usage_ratio(state), fragmentation_ratio(state)
            if usage is not None:
                self.max_usage_ratio = max(self.max_usage_ratio, usage)
            if frag is not None:
                self.max_fragmentation_ratio = max(self.max_fragmentation_ratio, frag)
            new += self._fresh("state", check_counts(state))
            if self.counted_hit_tokens is not None:  # read after the state: see the audit
                new += self._fresh("hit_counter", self.hit_counter.observe(
                    state.hit_tokens, int(self.counted_hit_tokens())))
            unheld = unheld_from_state(state)
        if tables is not None:
            started = time.perf_counter()
            found = [v for snap in tables for v in check_snapshot(snap)]
            if found and retake is not None:
                tables, found = _confirmed(tables, found, retake)
            new += self._fresh("tables", found)
            for snap in tables:
                new += self._double_frees_since_last(snap)
            unheld = sum(unheld_references(s) for s in tables)
            self.checks += 1
            self.metrics.inc(S.INVARIANT_CHECKS)
            self.metrics.observe(S.INVARIANT_CHECK_DURATION,
                                 snapshot_seconds + time.perf_counter() - started)

        self._observe_leak(unheld, request_index)
        if new:
            if self.first_violation_request is None:
                self.first_violation_request = request_index
            self._report(new, request_index)
        return new

    def observe_found(self, source: str, found: list[Violation],
                      request_index: int) -> list[Violation]:
        """One check an adapter ran itself on the engine's own structures (SGLang's slot
        census, :mod:`sidecar.adapters.sglang.census`): counted, de-duplicated against the
        previous check of the same ``source`` and reported like a poll's violations."""
        new = self._fresh(source, found)
        self.checks += 1
        self.metrics.inc(S.INVARIANT_CHECKS)
        if new:
            if self.first_violation_request is None:
                self.first_violation_request = request_index
            self._report(new, request_index)
        return new

    def _fresh(self, source: str, found: list[Violation]) -> list[Violation]:
        """Count and return the violations of ``found`` not seen at the previous poll."""
        before = self._active.get(source, set())
        keys: set[tuple[str, int, int | None, int, str]] = set()
        new: list[Violation] = []
        for v in found:
            if v.key not in before and v.key not in keys:
                new.append(v)
                self.metrics.inc(S.INVARIANT_VIOLATIONS, kind=v.kind.value)
            keys.add(v.key)
        self._active[source] = keys
        return new

    def _double_frees_since_last(self, snap: BlockTableSnapshot) -> list[Violation]:
        """The engine's own double-free count is a counter: count its increase."""
        before = self._double_frees.get(snap.group_id, 0)
        self._double_frees[snap.group_id] = snap.double_frees
        n = snap.double_frees - before
        if n <= 0:
            return []
        self.metrics.inc(S.INVARIANT_VIOLATIONS, n, kind=InvariantKind.DOUBLE_FREE.value)
        return [Violation(InvariantKind.DOUBLE_FREE, snap.group_id, None,
                          f"the engine refused {n} release(s) of blocks the releasing "
                          "sequence did not hold (double free)")]

    def _observe_leak(self, unheld: int | None, request_index: int) -> None:
        was = self.leak.suspected
        suspected = self.leak.observe(unheld)
        self.metrics.gauge(S.LEAK_SUSPECTED).set(self.leak.unheld)
        self.metrics.gauge(S.LEAK_SUSPECTED_FLAG).set(1 if suspected else 0)
        if suspected and not was:
            if self.first_leak_request is None:
                self.first_leak_request = request_index
            log.warning("KV block leak suspected: %d blocks held by no live sequence, rising "
                        "over the last %d polls (request %d)", self.leak.unheld,
                        self.leak.window, request_index)
            self.lifecycle.trigger()

    def _report(self, new: list[Violation], request_index: int) -> None:
        """Log lines and one evidence record, with the lifecycle path of the bad blocks."""
        self.lifecycle.trigger()
        blocks = list(dict.fromkeys((v.group_id, v.block_id) for v in new
                                    if v.block_id is not None))[:EVIDENCE_PATHS]
        paths, cut = self._paths(blocks)
        for v in new[:LOGGED_PER_POLL]:
            path = paths.get(f"{v.group_id}:{v.block_id}") or []
            op = _last_op(path[-1], v.block_id) if path else "no lifecycle event on record"
            log.warning("allocator invariant %s: group %d block %s gen %d: %s; %s "
                        "(request %d)", v.kind.value, v.group_id, v.block_id, v.generation,
                        v.detail, op, request_index)
        if len(new) > LOGGED_PER_POLL:
            log.warning("... and %d more allocator invariant violations at request %d",
                        len(new) - LOGGED_PER_POLL, request_index)
        self.evidence.add({
            "type": "invariant_violation",
            "engine": self.engine,
            "model": self.model,
            "request": request_index,
            "violations": [v.as_dict() for v in new[:EVIDENCE_VIOLATIONS]],
            "violations_total": len(new),
            "lifecycle": paths,
            "lifecycle_left_out": cut,
        })

    # ------------------------------------------------------------------ content anomalies
    def anomaly_context(self, refs: Iterable[BlockRef]) -> dict[str, Any]:
        """Evidence extra for a content anomaly: the lifecycle path of each checked block,
        and full-rate lifecycle logging from now on for a while."""
        self.lifecycle.trigger()
        paths, cut = self._paths((r.group_id, r.block_id) for r in refs)
        return {"lifecycle": paths, "lifecycle_left_out": cut}

    def _paths(self, blocks: Iterable[tuple[int, int]]
               ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
        """Each block's last :data:`PATH_EVENTS` lifecycle events, by ``"group:block"``,
        and for a path cut so, how many older events on record it left out (a cut path can
        start at a free or a hit: the count says there was more)."""
        paths: dict[str, list[dict[str, Any]]] = {}
        cut: dict[str, int] = {}
        for g, b in blocks:
            key = f"{g}:{b}"
            paths[key], left = self.lifecycle.path_and_cut(g, [b], PATH_EVENTS)
            if left:
                cut[key] = left
        return paths, cut

    # ------------------------------------------------------------------ summary
    def summary(self, state: AllocatorState | None) -> dict[str, Any]:
        t = THRESHOLDS
        failure_rate = allocation_failure_rate(state)
        exceeded = [name for name, over in (
            ("usage_ratio", self.max_usage_ratio > t.usage_ratio),
            ("allocation_failure_rate", failure_rate > t.allocation_failure_rate),
            ("fragmentation_ratio", self.max_fragmentation_ratio > t.fragmentation_ratio),
        ) if over]
        return {
            "invariant_violations": {k: int(v) for k, v in self.metrics.by_label(
                S.INVARIANT_VIOLATIONS.name, "kind").items()},
            "invariant_checks": self.checks,
            "first_invariant_violation_request": self.first_violation_request,
            "leak_suspected": self.leak.suspected,
            "leak_suspected_blocks": self.leak.unheld,
            "first_leak_suspected_request": self.first_leak_request,
            "allocation_failure_rate": failure_rate,
            "internal_fragmentation_ratio": (internal_fragmentation_ratio(state)
                                             if state else 0.0),
            "max_usage_ratio": self.max_usage_ratio,
            "max_fragmentation_ratio": self.max_fragmentation_ratio,
            "allocator_thresholds_exceeded": exceeded,
            "lifecycle_events": self.lifecycle.events,
        }
