"""The verifier: runs the checks on one sampled hit, cheapest first, and returns a Verdict.

Order (each stage only spends what the previous ones could not decide):
  1. key consistency (generation, token digest, key fields) — no adapter call at all;
  2. ``adapter.read`` (time-limited) — blocks whose generation changed since the match were
     legitimately reused before we got to them: dropped, not flagged;
  3. structure, content stats, write-time fingerprint — on the bytes just read;
  4. ``adapter.recompute`` under the recompute budget, compared with a dtype-aware tolerance —
     only for blocks no earlier stage already condemned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from sidecar.checks.base import Finding
from sidecar.checks.content import check_content
from sidecar.checks.fingerprint import check_fingerprint
from sidecar.checks.keys import StoreRecord, check_keys, hit_digests
from sidecar.checks.recompute import block_error
from sidecar.checks.structure import check_structure
from sidecar.guard import AdapterRefused, AdapterTimeout, Guard
from sidecar.protocol import Adapter, BlockKV, BlockRef, EngineInfo, Hit
from sidecar.signals import AnomalyKind, DropReason
from sidecar.tolerance import tolerance_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """What the hot path captured for one sampled hit."""

    hit: Hit
    refs: tuple[BlockRef, ...]
    records: Mapping[BlockRef, StoreRecord | None]
    captured_at: float


@dataclass
class Verdict:
    """The outcome of verifying one sample."""

    sample: Sample
    verified: list[BlockRef] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    dropped: dict[DropReason, int] = field(default_factory=dict)
    adapter_errors: list[tuple[str, str]] = field(default_factory=list)  # (op, reason)
    max_error: float | None = None  # largest recompute error seen (for noise-floor reports)
    duration_s: float = 0.0

    @property
    def anomalous(self) -> bool:
        return bool(self.findings)

    def kinds(self) -> set[AnomalyKind]:
        return {f.kind for f in self.findings}


class TokenBucket:
    """The recompute budget: at most ``rate`` recomputed tokens per second on average."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.capacity = burst if burst is not None else max(rate, 1.0)
        self._tokens = self.capacity
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: float) -> bool:
        if self.rate <= 0:
            return True  # unlimited
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if n > self.capacity:  # one oversized sample may run when the bucket is full
                n = self.capacity
            if self._tokens >= n:
                self._tokens -= n
                return True
            return False


class Verifier:
    """Runs the checks of one sample against an adapter (see the module docstring)."""

    def __init__(self, adapter: Adapter, info: EngineInfo, guard: Guard,
                 budget: TokenBucket, recompute: bool = True) -> None:
        self.adapter = adapter
        self.info = info
        self.guard = guard
        self.budget = budget
        self.recompute = recompute
        self.tolerance = tolerance_for(info.dtype, info.kv_storage)
        self._layers = {g.group_id: len(g.layers) for g in info.groups}

    def verify(self, sample: Sample) -> Verdict:
        started = time.perf_counter()
        verdict = Verdict(sample)
        try:
            self._run(sample, verdict)
        finally:
            verdict.duration_s = time.perf_counter() - started
        return verdict

    def _run(self, sample: Sample, verdict: Verdict) -> None:
        """A block counts as verified once some stage decided it: condemned by a check, or
        passed the last stage. Blocks nobody could decide (reused before the read, over
        budget, adapter failure) are dropped and counted by reason."""
        hit, refs = sample.hit, sample.refs
        if not refs:
            return
        bs = self.info.block_size
        digests = hit_digests(hit, bs, max(r.index for r in refs))
        condemned: set[BlockRef] = set()
        for ref in refs:
            found = check_keys(hit, ref, sample.records.get(ref), bs,
                               _generation_at_hit(hit, ref), digests)
            if found:
                condemned.add(ref)
                verdict.findings.extend(found)

        cached = self._call("read", self.adapter.read, verdict, hit, refs,
                            len(refs) - len(condemned))
        passed: list[BlockKV] = []
        asked = {r for r in refs if r not in condemned}
        got: set[BlockRef] = set()
        for block in cached or []:
            ref = block.ref
            if ref not in asked or ref in got:  # never asked for (or twice): not evidence
                verdict.adapter_errors.append(("read", "unexpected_block"))
                continue
            got.add(ref)
            at_hit = _generation_at_hit(hit, ref)
            if block.generation is not None and at_hit is not None \
                    and block.generation != at_hit:
                _drop(verdict, DropReason.EVICTED_BEFORE_READ)
                continue
            n_layers = self._layers.get(ref.group_id, block.key.shape[0])
            found = check_structure(block, self.info, n_layers) or check_content(block)
            if not found:
                record = sample.records.get(ref)
                found = check_fingerprint(block, record.kv_digest if record else None)
            if found:
                condemned.add(ref)
                verdict.findings.extend(found)
            else:
                passed.append(block)

        if cached is not None and len(got) < len(asked):  # asked for, never returned
            verdict.adapter_errors.append(("read", "missing_block"))
            _drop(verdict, DropReason.ADAPTER_ERROR)
        verdict.verified.extend(r for r in refs if r in condemned)
        if not passed:
            return
        if not self.recompute:
            verdict.verified.extend(b.ref for b in passed)
            return
        self._compare(hit, passed, verdict)

    def _compare(self, hit: Hit, blocks: Sequence[BlockKV], verdict: Verdict) -> None:
        cost = (max(b.ref.index for b in blocks) + 1) * self.info.block_size
        if not self.budget.take(cost):
            _drop(verdict, DropReason.BUDGET, len(blocks))
            return
        reference = self._call("recompute", self.adapter.recompute, verdict, hit,
                               [b.ref for b in blocks], len(blocks))
        if reference is None:
            return
        by_ref = {r.ref: r for r in reference}
        if any(ref not in {b.ref for b in blocks} for ref in by_ref):
            verdict.adapter_errors.append(("recompute", "unexpected_block"))
        for block in blocks:
            ref_kv = by_ref.get(block.ref)
            if ref_kv is None:
                verdict.adapter_errors.append(("recompute", "missing_block"))
                _drop(verdict, DropReason.ADAPTER_ERROR)
                continue
            err = block_error(block, ref_kv)
            verdict.max_error = err if verdict.max_error is None else max(verdict.max_error, err)
            verdict.verified.append(block.ref)
            if err > self.tolerance:
                verdict.findings.append(Finding(
                    AnomalyKind.RECOMPUTE_MISMATCH, block.ref.group_id, block.ref.index,
                    f"normalized error {err:.3g} > tolerance {self.tolerance:.3g} "
                    f"({self.info.dtype})", err))

    def _call(self, op: str, fn: Callable[[Hit, Sequence[BlockRef]], Sequence[BlockKV]],
              verdict: Verdict, hit: Hit, refs: Sequence[BlockRef],
              at_stake: int) -> list[BlockKV] | None:
        """A guarded adapter call; on failure, ``at_stake`` undecided blocks are dropped."""
        try:
            out = self.guard.call(op, fn, hit, refs)
            blocks = [b for b in out if isinstance(b, BlockKV) and isinstance(b.ref, BlockRef)]
            if len(blocks) != len(out):  # garbage from the adapter: skipped and counted
                verdict.adapter_errors.append((op, "garbage"))
            return blocks
        except AdapterTimeout:
            verdict.adapter_errors.append((op, "timeout"))
            _drop(verdict, DropReason.ADAPTER_TIMEOUT, at_stake)
        except AdapterRefused:
            verdict.adapter_errors.append((op, "refused"))
            _drop(verdict, DropReason.ADAPTER_TIMEOUT, at_stake)
        except Exception as exc:  # an adapter bug (AdapterExit too) is counted, never fatal
            log.warning("adapter %s failed: %s: %s", op, type(exc).__name__, exc)
            verdict.adapter_errors.append((op, "error"))
            _drop(verdict, DropReason.ADAPTER_ERROR, at_stake)
        return None


def _generation_at_hit(hit: Hit, ref: BlockRef) -> int | None:
    gens = hit.generations.get(ref.group_id)
    return int(gens[ref.index]) if gens is not None and ref.index < len(gens) else None


def _drop(verdict: Verdict, reason: DropReason, n: int = 1) -> None:
    """Record that ``n`` blocks of this sample could not be decided for ``reason``. The
    drop counter counts *samples* (one per reason per sample, however many blocks), so
    ``samples_dropped_total / sampled_total`` is a ratio of like with like."""
    if n > 0:
        verdict.dropped[reason] = 1
