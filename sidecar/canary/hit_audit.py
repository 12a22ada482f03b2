"""The hit-rate audit: the server's own hit counters against what the pairs prove.

Public reports show hit counters that lie (preempted tokens counted as hits, a hits counter
stuck at 0 while hits happen, ``cached_tokens`` for hits that never happened). The canary
knows the truth for its own probes: the first send of a fresh random prompt cannot hit, and
the immediate repeat can hit at most ``len - 1`` tokens, and on a working prefix cache hits
exactly :func:`~sidecar.canary.probes.expected_cached`. Two sources are audited:

* ``usage.prompt_tokens_details.cached_tokens`` of each probe answer (per pair);
* the server's ``/metrics`` prefix-cache hit counter (vLLM: ``vllm:prefix_cache_hits``, in
  tokens), which must grow at least by the hits the canary proved, whatever other traffic
  adds. It is compared one audit tick late, so a counter updated just after the answer was
  sent is not a false alarm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.canary.probes import PairResult, expected_cached
from sidecar.signals import AuditKind

# Counters (summed over labels) that count prompt tokens served from the prefix cache.
SERVER_HIT_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits",
                       "sglang:cached_tokens_total")


def counter_sum(text: str, names: tuple[str, ...] = SERVER_HIT_COUNTERS) -> float | None:
    """Sum of the first of ``names`` present in a Prometheus text exposition (None: absent)."""
    for name in names:
        total, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            metric = line.split("{", 1)[0].split(" ", 1)[0]
            if metric == name:
                try:
                    value = float(line.rsplit(" ", 1)[1])
                except (ValueError, IndexError):
                    continue
                if not math.isfinite(value) or value < 0:
                    continue  # a counter is finite and >= 0: a broken line says nothing
                total += value
                seen = True
        if seen:
            return total
    return None


@dataclass(frozen=True)
class PairAudit:
    expected: int  # hit tokens the pair proves a working prefix cache serves
    reported: int | None  # cached tokens the server reported for the hit
    mismatches: tuple[AuditKind, ...]


def audit_pair(pair: PairResult, block_size: int) -> PairAudit:
    """Check the cached tokens the server reported for each request of a pair."""
    kinds: list[AuditKind] = []
    n = pair.prompt_len
    expected = expected_cached(n, block_size)
    for miss in (pair.first, pair.reference):
        if miss is not None and (miss.cached_tokens or 0) > 0:
            kinds.append(AuditKind.PHANTOM_HIT)
    reported = pair.hit.cached_tokens
    if reported is not None:
        if reported > n - 1:
            kinds.append(AuditKind.OVER_REPORTED)
        elif reported < expected:
            kinds.append(AuditKind.UNDER_REPORTED)
    return PairAudit(expected, reported, tuple(kinds))


def proven_hit_tokens(audit: PairAudit) -> int:
    """Hit tokens the server's hit counter must have counted for this pair: the expected
    hit, or the server's own smaller report when it says the cache did not serve it all
    (eviction under pressure is legitimate; a counter behind the server's own answers is
    not)."""
    if audit.reported is None:
        return audit.expected
    return min(audit.expected, max(0, audit.reported))


class MetricsAudit:
    """The server's ``/metrics`` hit counter must grow by at least the canary's proven hits.

    ``tick(counter)`` compares the counter's growth since the first tick with the hits the
    canary had proven by the previous tick; it returns True when the counter fell short."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.proven = 0  # hit tokens proven by pairs so far
        self._proven_at_last_tick = 0

    def add_proven(self, tokens: int) -> None:
        self.proven += tokens

    def tick(self, counter: float | None) -> bool:
        if counter is None:
            return False
        if self.start is None or counter < self.start:  # first read, or a server restart
            self.start = counter
            self._proven_at_last_tick = self.proven = 0
            return False
        short = counter - self.start < self._proven_at_last_tick
        self._proven_at_last_tick = self.proven
        return short
