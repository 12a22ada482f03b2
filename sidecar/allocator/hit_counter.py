"""The hit-counter audit: the engine's own prefix-cache hit counter against the hits the
sidecar counted from the engine's lookups.

A hit rate that looks healthy is what every cache dashboard shows, so the number has to be
right. Public reports show it is not always: a hit metric that is a gauge overwritten with
each batch's hits (SGLang 26608: a health probe's batch resets it), a counter stuck at 0,
preempted tokens counted as hits. The sidecar counts every hit the engine reports through
its lookups (``kvsidecar_hit_tokens_total``); an adapter that also reads the engine's own
counter hands it over as :attr:`~sidecar.core.protocol.AllocatorState.hit_tokens`, and each
poll compares the two:

* **went down**: a counter never decreases. Either it is not a counter or the engine
  restarted under an attached sidecar (which an adapter re-attaches for);
* **fell behind**: since the baseline, the engine's counter grew less than the hits the
  sidecar had counted by the *previous* poll, by more than the most hit tokens the sidecar
  ever counted between two polls. Every hit the sidecar counts was counted by the engine
  first, so the previous poll's count is a floor; the slack covers hits the engine had
  counted but not yet reported when the baseline was read. A per-batch gauge falls behind
  by everything but its last batch, which outgrows any one interval within a few polls.

Only an engine counter *behind* the sidecar's is flagged: the sidecar may miss lookups
(refused input, lost events), so an engine counter ahead of it proves nothing. Each finding
is a :class:`~sidecar.allocator.invariants.Violation` of kind ``hit_counter_mismatch`` and
starts a new baseline, so one broken counter is counted once per poll that shows it.
"""

from __future__ import annotations

from sidecar.allocator.invariants import Violation
from sidecar.signals import InvariantKind


class HitCounterAudit:
    """Compares, poll after poll, the engine's hit counter with the sidecar's count (see
    the module docstring). Read the engine's counter before the sidecar's at each poll."""

    def __init__(self) -> None:
        self._base: tuple[int, int] | None = None  # (engine, sidecar) at the baseline
        self._last: tuple[int, int] | None = None  # (engine, sidecar) at the previous poll
        self.slack = 0  # most hit tokens the sidecar counted between two polls
        self.mismatches = 0

    def observe(self, reported: int | None, counted: int) -> list[Violation]:
        """One poll: ``reported`` is the engine's counter (``None``: it has none, nothing
        is checked), ``counted`` the hit tokens the sidecar counted, read after it."""
        if reported is None:
            return []
        last = self._last
        self._last = (reported, counted)
        if last is None or self._base is None:
            self._base = (reported, counted)
            return []
        self.slack = max(self.slack, counted - last[1])
        if reported < last[0]:
            return self._found(f"the engine's hit counter went down from {last[0]} to "
                               f"{reported} tokens: it is not a counter (a gauge overwritten "
                               "per batch?) or the engine restarted")
        grew = reported - self._base[0]
        seen = last[1] - self._base[1]
        if seen - grew > self.slack:
            return self._found(f"the engine's hit counter grew by {grew} tokens while the "
                               f"sidecar counted {seen} hit tokens from its lookups")
        return []

    def _found(self, detail: str) -> list[Violation]:
        self.mismatches += 1
        self._base = self._last
        return [Violation(InvariantKind.HIT_COUNTER_MISMATCH, 0, None, detail)]
