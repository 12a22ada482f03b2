"""Leak detection: a trend test on blocks that only go in (seed 001 §6.3).

A leak is a reference the allocator counts that no live sequence holds: allocated, never
freed. In a healthy engine such *unheld* references are zero at any consistent snapshot (or
a transient blip where the engine's counts and its block tables are read at slightly
different moments). A leak makes them a floor that only rises, and the free blocks fall
with it while the live sequences do not grow.

Each poll contributes one number, ``unheld``:

* with a block-table snapshot (:class:`~sidecar.core.protocol.AllocatorIntrospection`): the sum
  over blocks of ref count minus live block-table references, where positive
  (:func:`sidecar.allocator.invariants.unheld_references`). References, not blocks: a
  leaked block that stays indexed is hit and held by live sequences now and then, so a
  count of blocks nobody holds dips, while its leaked reference stays;
* else, from :class:`~sidecar.core.protocol.AllocatorState`: ``used_blocks - held_blocks`` when
  the engine reports ``held_blocks``; or ``used_blocks`` at a poll with
  ``live_sequences == 0`` (an idle engine should hold nothing); otherwise the poll says
  nothing and is skipped.

The test, over the last ``window`` informative polls: **leak suspected** when ``unheld``
was > 0 at every one of them, never decreased from one poll to the next, and the last value
exceeds the first by at least ``min_growth`` blocks. Each condition removes a false
alarm: > 0 everywhere rules out transients, never decreasing rules out blocks that are
merely slow to come back, growth rules out a constant offset an engine keeps on purpose.
The suspicion clears when ``unheld`` falls back to 0.
"""

from __future__ import annotations

from collections import deque

from sidecar.core.protocol import AllocatorState


def unheld_from_state(state: AllocatorState) -> int | None:
    """``unheld`` from counts alone, or ``None`` when this poll cannot tell."""
    if state.used_blocks is None:
        return None
    if state.held_blocks is not None:
        return max(0, state.used_blocks - state.held_blocks)
    if state.live_sequences == 0:
        return state.used_blocks
    return None


class LeakTrend:
    """See the module docstring."""

    def __init__(self, window: int = 8, min_growth: int = 1) -> None:
        if window < 2 or min_growth < 1:
            raise ValueError("window must be >= 2 and min_growth >= 1")
        self.window = window
        self.min_growth = min_growth
        self._values: deque[int] = deque(maxlen=window)
        self.suspected = False
        self.unheld = 0

    def observe(self, unheld: int | None) -> bool:
        """Add one poll's ``unheld`` (``None``: nothing known); returns ``suspected``."""
        if unheld is None:
            return self.suspected
        self.unheld = unheld
        if unheld <= 0:
            self._values.clear()
            self.suspected = False
            return False
        self._values.append(unheld)
        v = self._values
        if (len(v) == self.window
                and all(a <= b for a, b in zip(v, list(v)[1:], strict=False))
                and v[-1] - v[0] >= self.min_growth):
            self.suspected = True
        return self.suspected
