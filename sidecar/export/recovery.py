"""Per-group hot-path signals of a hybrid cache: hits per cache group, and the offload tier's
recoveries (loads) from the engine's ``on_tier`` events (:class:`sidecar.core.protocol.TierSink`).

Both run on the engine's thread, so both are O(1) through pre-made cells: every label set
is bounded and created at start (the engine's groups x a fixed outcome set), so an update
is one dict lookup and one add. A group id the engine never described is counted under
the one ``unknown`` group value, never as a new series. Bad ``on_tier`` input is
rejected with a reason (``hook_input_rejected_total{hook="on_tier"}``), never applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from sidecar import signals as S
from sidecar.core.hook_input import MAX_LATENCY_S
from sidecar.core.protocol import EngineInfo, Hit, TierState
from sidecar.export.metrics import Metrics
from sidecar.signals import InputReject, RecoveryOutcome

UNKNOWN = "unknown"
_ENDS = {TierState.LOADED: RecoveryOutcome.LOADED, TierState.FAILED: RecoveryOutcome.FAILED}
_STATES = {s.value: s for s in TierState}


class GroupSignals:
    """Hits per cache group, and the tier's recoveries by group and outcome."""

    def __init__(self, metrics: Metrics, info: EngineInfo) -> None:
        labels = {g.group_id: (g.label, g.kind.value) for g in info.groups}
        self._hits: dict[int, Any] = {
            gid: metrics.cell(S.GROUP_HITS, group=label, group_kind=kind)
            for gid, (label, kind) in labels.items()}
        self._unknown_hits = metrics.cell(S.GROUP_HITS, group=UNKNOWN, group_kind=UNKNOWN)
        self.single = len(labels) == 1
        if self.single:  # every hit is a hit of the one group: share the hits cell
            (gid, (label, kind)), = labels.items()
            hits = metrics.cell(S.HITS)
            metrics.instruments.family(S.GROUP_HITS).series[(label, kind)] = hits
            self._hits[gid] = hits
        self._ends: dict[tuple[int, TierState], Any] = {}
        self._durations: dict[int, Any] = {}
        for gid, (label, _) in [*labels.items(), (-1, (UNKNOWN, UNKNOWN))]:
            for state, outcome in _ENDS.items():
                self._ends[(gid, state)] = metrics.cell(S.RECOVERIES, group=label,
                                                        outcome=outcome.value)
            self._durations[gid] = metrics.cell(S.RECOVERY_DURATION, group=label)
        self._groups = frozenset(labels)
        # Series a first event must find at 0 (a rate, not a new series).
        for group_kind in sorted({g.kind.value for g in info.groups}):
            for kind in S.AnomalyKind:
                metrics.inc(S.GROUP_KIND_ANOMALIES, 0, group_kind=group_kind, kind=kind.value)
        for why in InputReject:
            metrics.inc(S.HOOK_INPUT_REJECTED, 0, hook="on_tier", reason=why.value)

    def wrap(self, should_sample: Callable[[Hit], bool]) -> Callable[[Hit], bool]:
        """The hot path's sampling decision, counting a hybrid hit's groups first; a
        one-group engine's is returned as is (its group's hits are the hits counter)."""
        if self.single:
            return should_sample
        on_hit = self.on_hit

        def count_then_decide(hit: Hit) -> bool:
            on_hit(hit)
            return should_sample(hit)
        return count_then_decide

    def on_hit(self, hit: Hit) -> None:
        """One more hit in every group the hit lists (a one-group engine counts them in
        the hits counter itself)."""
        if self.single:
            return
        hits = self._hits
        for gid in hit.blocks:
            cell = hits.get(gid)
            if cell is None:
                cell = self._unknown_hits
            cell.value += 1

    def on_tier(self, group_id: Any, block_id: Any, state: Any,
                seconds: Any = None) -> InputReject | None:
        """Apply one tier transition; a reason when its input is refused (nothing applied).
        Only the end of a load (``loaded``/``failed``) is a recovery signal."""
        if type(group_id) is not int or type(block_id) is not int:
            return InputReject.TYPE
        if group_id < 0 or block_id < 0:
            return InputReject.NEGATIVE
        if type(state) is not TierState:
            state = _STATES.get(state) if isinstance(state, str) else None
            if state is None:
                return InputReject.TYPE
        if seconds is not None:
            if type(seconds) not in (float, int):
                return InputReject.TYPE
            if math.isnan(seconds):
                return InputReject.NAN
            if seconds < 0:
                return InputReject.NEGATIVE
            if seconds > MAX_LATENCY_S:
                return InputReject.ABSURD
        if state not in _ENDS:
            return None
        gid = group_id if group_id in self._groups else -1
        self._ends[(gid, state)].value += 1
        if seconds is not None:
            self._durations[gid].observe(float(seconds))
        return None
