"""A start burst: sample at a higher rate for the first hits after start, after an engine
restart and after an upgrade (a new version, KV layout or kernel), then decay to 1 in N.

A fault that arrives with an upgrade (a connector reading the old layout: vLLM PR 44455 ->
LMCache 4247, 4463) breaks every shared-prefix hit at once, and at 1 in 1,000 the first
sample may be minutes away. The samplers of :mod:`sidecar.core.sampling` hold a :class:`Burst`
and account it on their sampled branch only, so the unsampled fast path is unchanged.
"""

from __future__ import annotations


class Burst:
    """A higher sampling rate for a number of hits (see the module docstring): 1 in
    ``every`` for ``hits`` hits from start and from each :meth:`rearm`."""

    def __init__(self, hits: int = 0, every: int = 1) -> None:
        if hits < 0 or every < 1:
            raise ValueError(f"burst hits must be >= 0 and burst every >= 1, got {hits}, "
                             f"{every}")
        self.hits, self.every = hits, every
        self.left = hits  # hits still in the burst
        self.reason = "start" if hits else ""
        self.armed = 1 if hits else 0  # bursts so far (start included)

    def rearm(self, reason: str) -> None:
        """Start a burst again (``reason``: restart, upgrade, layout, ...)."""
        if self.hits:
            self.left, self.reason = self.hits, reason
            self.armed += 1

    def step(self, normal: int) -> int:
        """After a sample: hits until the next one (the burst's step while it lasts)."""
        every = min(self.every, normal)
        if self.left <= 0:
            return normal
        self.left -= every
        return every

    def current_every(self, normal: int) -> int:
        """1 in how many hits are sampled now."""
        return min(self.every, normal) if self.left > 0 else normal


