"""The verifier: runs the checks on one sampled hit, cheapest first, and returns a Verdict.

Order (each stage only spends what the previous ones could not decide):
  0. the hit's ids (:func:`sidecar.core.hit_input.sanitized_hit`): a bad one is counted;
  1. identity (:mod:`sidecar.checks.identity`): key consistency, coverage per cache group
     (a hit listing no block is judged on this alone);
  2. ``adapter.read`` (time-limited) — blocks reused since the match: dropped, not flagged;
  3. structure, content stats, write-time fingerprint — on the bytes just read;
  4. ``adapter.recompute`` under the recompute budget, compared with a dtype-aware tolerance —
     only for blocks no earlier stage already condemned. The tolerance is per reference kind
     (the adapter's ``reference_kind``: "independent" unless it says "engine") and dtype, and
     may be calibrated from the first clean blocks (:mod:`sidecar.checks.calibration`); every
     block's error is on the verdict (``errors``) for the error histogram. Each group is
     compared on the positions it keeps (block choice: :mod:`sidecar.core.sampling`) and its own
     layers; a failed compare is explained per group kind (:mod:`sidecar.checks.hybrid`:
     window off by a block, stale recurrent state, partial tier load).

Admission (:mod:`sidecar.core.admission`): recomputes in flight and verifications through
an offload tier are capped; over one, dropped (``admission``), not queued.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from sidecar.checks.base import Finding
from sidecar.checks.calibration import Calibration
from sidecar.checks.content import check_content
from sidecar.checks.coverage import check_coverage, tier_state_at
from sidecar.checks.fingerprint import fingerprint_check
from sidecar.checks.hybrid import check_partial_zero, explain
from sidecar.checks.identity import check_identity
from sidecar.checks.keys import StoreRecord, generation_at_hit, token_ids_problem
from sidecar.checks.recompute import block_error
from sidecar.checks.recompute_budget import RecomputeBudget
from sidecar.checks.structure import check_structure
from sidecar.core.admission import Gate
from sidecar.core.attach import Capabilities, resolve
from sidecar.core.hit_input import sanitized_hit
from sidecar.core.protocol import (
    Adapter,
    BlockKV,
    BlockRef,
    BlockWrite,
    EngineInfo,
    GroupKind,
    Hit,
    WritePath,
)
from sidecar.core.time_limits import AdapterRefused, AdapterTimeout, Guard
from sidecar.signals import AnomalyKind, DropReason, InputReject

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    """What the hot path took for one sampled hit, at match time: the blocks chosen, their
    store records and the sidecar's epochs for them, and (where the adapter offers
    ``capture``) a copy of the KV the request was served."""

    hit: Hit
    refs: tuple[BlockRef, ...]
    records: Mapping[BlockRef, StoreRecord | None]
    captured_at: float
    epochs: Mapping[BlockRef, int] = field(default_factory=dict)
    captured: Mapping[BlockRef, BlockKV] | None = None
    writes: Mapping[BlockRef, BlockWrite] = field(default_factory=dict)  # a probe's, at write


@dataclass
class Verdict:
    """The outcome of verifying one sample."""

    sample: Sample
    verified: list[BlockRef] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    dropped: dict[DropReason, int] = field(default_factory=dict)
    adapter_errors: list[tuple[str, str]] = field(default_factory=list)  # (op, reason)
    max_error: float | None = None  # largest recompute error seen (for noise-floor reports)
    errors: list[tuple[int, float]] = field(default_factory=list)  # (group_id, error) per block
    duration_s: float = 0.0
    # The bytes behind each condemned block, for the evidence (sidecar.evidence.record): what was
    # served and, where the recompute ran, the reference (None: condemned before it).
    kv: dict[BlockRef, tuple[BlockKV, BlockKV | None]] = field(default_factory=dict)
    tolerance: float | None = None  # the recompute tolerance the comparison used
    fingerprints: dict[BlockRef, bool] = field(default_factory=dict)  # digest at write matched

    @property
    def anomalous(self) -> bool:
        return bool(self.findings)

    def kinds(self) -> set[AnomalyKind]:
        return {f.kind for f in self.findings}


class Verifier:
    """Runs the checks of one sample against an adapter (see the module docstring)."""

    def __init__(self, adapter: Adapter, info: EngineInfo, guard: Guard,
                 budget: RecomputeBudget, recompute: bool = True,
                 epoch_of: Callable[[int, int], int] | None = None,
                 calibration: Calibration | None = None,
                 max_recomputes: int = 0, max_recoveries: int = 0,
                 capabilities: Capabilities | None = None,
                 reject: Callable[[str, InputReject | None], bool] | None = None) -> None:
        self.adapter = adapter
        # Counts a hit whose ids are not ids (hook_input_rejected_total): True if refused.
        self.reject = reject or (lambda hook, why: why is not None)
        self.epoch_of = epoch_of
        # As resolved at attach (sidecar.core.attach), or here for a verifier on its own.
        self.capabilities = caps = capabilities or resolve(adapter, quiet=True)
        # ``reread = False`` (an out-of-process probe): captures are judged without a read.
        self.reread = caps.reread
        self.info = info
        self.guard = guard
        self.budget = budget
        self.recompute = recompute
        self.calibration = calibration or Calibration(info.dtype, info.kv_storage)
        self._layers = {g.group_id: len(g.layers) for g in info.groups}
        self._groups = {g.group_id: g for g in info.groups}
        self.recomputes = Gate("recompute", max_recomputes)
        self.recoveries = Gate("recovery", max_recoveries)
        self.bad_tokens = 0  # samples dropped for their token ids (logged at 1, 10, 100..)

    @property
    def reference_kind(self) -> str:
        """What the adapter's recompute is (sidecar.core.capabilities.REFERENCE_KINDS: a
        bounded label), read per call: an adapter may swap its reference at run time."""
        return self.capabilities.reference_kind()

    @property
    def tolerance(self) -> float:
        """The tolerance a comparison uses now (for the current reference)."""
        return self.calibration.tolerance(self.reference_kind)

    def verify(self, sample: Sample) -> Verdict:
        started = time.perf_counter()
        hit, why = sanitized_hit(sample.hit, self.info.groups)  # read once: the copy after
        if self.reject("on_lookup", why) or hit is None:
            return Verdict(sample)  # nothing verified
        verdict = Verdict(sample := replace(sample, hit=hit))
        # Blocks served through an offload tier are re-read through its load path: a
        # recovery slot for the whole verification, or the sample is dropped.
        recovered = any(tier_state_at(sample.hit, r.group_id, r.index) is not None
                        for r in sample.refs)
        slot = self.recoveries.enter() if recovered else None
        try:
            if recovered and slot is None:
                _drop(verdict, DropReason.ADMISSION, len(sample.refs))
            else:
                self._run(sample, verdict)
        finally:
            if slot is not None:
                slot.release()
            verdict.duration_s = time.perf_counter() - started
        return verdict

    def _run(self, sample: Sample, verdict: Verdict) -> None:
        """A block is verified once a stage decided it (condemned, or passed the last one);
        one none could (reused before the read, over budget, adapter failure): a counted drop."""
        hit, refs = sample.hit, sample.refs
        if not refs:
            verdict.findings.extend(check_coverage(hit, self.info))
            return
        problem = token_ids_problem(hit, self.info.block_size * (max(r.index for r in refs) + 1))
        if problem is not None:  # never hashed, recomputed or recorded: a counted drop
            self.bad_tokens += 1
            if math.log10(self.bad_tokens).is_integer():
                log.warning("sample dropped (bad_tokens, %d so far): %s", self.bad_tokens,
                            problem)
            return _drop(verdict, DropReason.BAD_TOKENS, len(refs))
        findings, condemned = check_identity(hit, refs, sample.records, self.info,
                                             self._groups)
        verdict.findings.extend(findings)

        # What was served: the capture where there is one, else the block as read now.
        # A captured block is read too, to tell "changed after serving" apart.
        captured = sample.captured or {}
        # A null (padding) block holds no KV: never read, whoever chose it (a probe's own
        # sampler); one at a position its group must cover was reported by the coverage check.
        undecided = [r for r in refs if r not in condemned and not self._null(r)]
        served: dict[BlockRef, BlockKV] = {r: captured[r] for r in undecided if r in captured}
        to_read = undecided if self.reread else [r for r in undecided if r not in served]
        cached = self._call("read", self.adapter.read, verdict, hit, to_read,
                            sum(1 for r in to_read if r not in served)) if to_read else []
        asked = set(to_read)
        got: set[BlockRef] = set()
        for block in cached or []:
            ref = block.ref
            if ref not in asked or ref in got:  # never asked for (or twice): not evidence
                verdict.adapter_errors.append(("read", "unexpected_block"))
                continue
            got.add(ref)
            if self._moved(sample, ref, block):  # legitimately reused since the match
                _drop(verdict, DropReason.REUSED_AFTER_SERVING if ref in served
                      else DropReason.EVICTED_BEFORE_READ)
                continue
            first = served.get(ref)
            if first is None:
                served[ref] = block
            elif not _same_bytes(first, block):
                verdict.findings.append(Finding(
                    AnomalyKind.CHANGED_AFTER_SERVING, ref.group_id, ref.index,
                    f"block {ref.block_id} changed in place after it was served "
                    "(neither freed nor stored again since the match)"))
        passed: list[BlockKV] = []
        for ref, block in served.items():
            n_layers = self._layers.get(ref.group_id, block.key.shape[0])
            group = self._groups.get(ref.group_id)
            kind = group.kind if group is not None else GroupKind.FULL_ATTENTION
            found = check_structure(block, self.info, n_layers, kind)
            if not found and tier_state_at(hit, ref.group_id, ref.index) is not None:
                found = check_partial_zero(block)  # before "zeros" claims a half-copied block
            found = found or check_content(block, hit.tokens, self.info.block_size)
            if not found:
                found = self._fingerprint(sample, block, verdict)
            if found:
                condemned.add(ref)
                verdict.findings.extend(found)
                verdict.kv[ref] = (block, None)
            else:
                passed.append(block)

        missing = [r for r in to_read if r not in got] if cached is not None else []
        # Left out because it is gone (Adapter.read's contract), as the journal saw it.
        gone = [r for r in missing if self._epoch_moved(sample, r)]
        for r in gone:
            _drop(verdict, DropReason.REUSED_AFTER_SERVING if r in captured
                  else DropReason.EVICTED_BEFORE_READ)
        if len(gone) < len(missing):  # asked for, never returned, still there
            verdict.adapter_errors.append(("read", "missing_block"))
            if any(r not in gone and r not in captured for r in missing):  # nothing to judge
                _drop(verdict, DropReason.ADAPTER_ERROR)
        verdict.verified.extend(r for r in refs if r in condemned)
        if not passed:
            return
        if not self.recompute:
            verdict.verified.extend(b.ref for b in passed)
            return
        self._compare(hit, passed, verdict)

    def _fingerprint(self, sample: Sample, block: BlockKV, verdict: Verdict) -> list[Finding]:
        """The write-time digest (the store record's, else the probe's) vs the bytes served."""
        record, write = sample.records.get(block.ref), sample.writes.get(block.ref)
        stored = record.kv_digest if record else None
        found, matched = fingerprint_check(block, stored) if stored or write is None \
            else fingerprint_check(block, write.kv_digest, write.served_digest)
        if matched is not None:
            verdict.fingerprints[block.ref] = matched
        return found

    def _null(self, ref: BlockRef) -> bool:
        group = self._groups.get(ref.group_id)
        return group is not None and ref.block_id in group.null_block_ids

    def _epoch_moved(self, sample: Sample, ref: BlockRef) -> bool:
        """Whether the journal saw the block freed or stored again since the match."""
        return self.epoch_of is not None and ref in sample.epochs \
            and self.epoch_of(ref.group_id, ref.block_id) != sample.epochs[ref]

    def _moved(self, sample: Sample, ref: BlockRef, block: BlockKV) -> bool:
        """Whether the block was freed or stored again between the match and this read: the
        sidecar's epoch moved, or the engine's generation stamp did."""
        at_hit = generation_at_hit(sample.hit, ref)
        return self._epoch_moved(sample, ref) or (
            block.generation is not None and at_hit is not None and block.generation != at_hit)

    def _compare(self, hit: Hit, blocks: Sequence[BlockKV], verdict: Verdict) -> None:
        cost = (max(b.ref.index for b in blocks) + 1) * self.info.block_size
        if not self.budget.take(cost):
            _drop(verdict, DropReason.BUDGET, len(blocks))
            return
        reference = self._recompute(hit, [b.ref for b in blocks], verdict, len(blocks))
        if reference is None:
            return
        by_ref = {r.ref: r for r in reference}
        if any(ref not in {b.ref for b in blocks} for ref in by_ref):
            verdict.adapter_errors.append(("recompute", "unexpected_block"))
        kind = self.reference_kind
        cal = self.calibration
        writes = verdict.sample.writes
        failed: list[tuple[BlockKV, float]] = []
        for block in blocks:
            ref_kv = by_ref.get(block.ref)
            if ref_kv is None:
                verdict.adapter_errors.append(("recompute", "missing_block"))
                _drop(verdict, DropReason.ADAPTER_ERROR)
                continue
            if block.key.shape != ref_kv.key.shape or block.value.shape != ref_kv.value.shape:
                verdict.verified.append(block.ref)  # a layout the reference does not have
                verdict.findings.append(Finding(
                    AnomalyKind.STRUCTURE, block.ref.group_id, block.ref.index,
                    f"shape {tuple(block.key.shape)}/{tuple(block.value.shape)} != the "
                    f"recompute's {tuple(ref_kv.key.shape)}/{tuple(ref_kv.value.shape)}"))
                continue
            err = block_error(block, ref_kv)
            if not math.isfinite(err):  # NaN (a non-finite reference) compares as far out
                err = math.inf
            verdict.max_error = err if verdict.max_error is None else max(verdict.max_error, err)
            verdict.errors.append((block.ref.group_id, err))
            verdict.verified.append(block.ref)
            # Per write path: a prefill recompute of a decode-written block rounds apart.
            # The probe's record at write, else the engine's store event's.
            record = verdict.sample.records.get(block.ref)
            path = writes[block.ref].write_path if block.ref in writes \
                else record.write_path if record is not None else WritePath.ALL
            tol = cal.tolerance(kind, path)
            passed = err <= tol
            if not passed and cal.refute_exact(kind, path, err):  # exact was a guess
                tol, passed = cal.tolerance(kind, path), True
            if not passed or not failed:  # the tolerance a failure was judged by
                verdict.tolerance = tol
            cal.observe(kind, err, passed, path)
            if not passed:
                verdict.kv[block.ref] = (block, ref_kv)  # for the evidence record
                failed.append((block, err))
        if failed:
            self._explain(hit, failed, by_ref, verdict)

    def _explain(self, hit: Hit, failed: list[tuple[BlockKV, float]],
                 references: dict[BlockRef, BlockKV], verdict: Verdict) -> None:
        """Name each failed block's fault family (:func:`sidecar.checks.hybrid.explain`);
        the neighbour recomputes it may need take a recompute slot like any other."""
        tol, kind = verdict.tolerance or 0.0, self.reference_kind  # set with the failure
        dtype = self.info.dtype

        def recompute(refs: Sequence[BlockRef]) -> Sequence[BlockKV] | None:
            return self._recompute(hit, refs, verdict, 0)

        verdict.findings.extend(explain(
            failed, self._groups,
            lambda r: tier_state_at(hit, r.group_id, r.index) is not None, references,
            recompute, len(hit.tokens) // self.info.block_size, tol,
            lambda err: f"normalized error {err:.3g} > tolerance {tol:.3g} "
                        f"({dtype}, {kind} reference)"))

    def _recompute(self, hit: Hit, refs: Sequence[BlockRef], verdict: Verdict,
                   at_stake: int) -> list[BlockKV] | None:
        """``adapter.recompute`` under a recompute slot, held until the call really ends
        (an abandoned, timed-out call keeps it); no slot: dropped for admission."""
        slot = self.recomputes.enter()
        if slot is None:
            _drop(verdict, DropReason.ADMISSION, at_stake)
            return None
        ran = threading.Event()

        def run(h: Hit, r: Sequence[BlockRef]) -> Sequence[BlockKV]:
            ran.set()
            try:
                return self.adapter.recompute(h, r)
            finally:
                slot.release()
        try:
            return self._call("recompute", run, verdict, hit, refs, at_stake)
        finally:
            if not ran.is_set():  # refused before it started: nothing holds the slot
                slot.release()

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
            _drop(verdict, DropReason.ADAPTER_REFUSED, at_stake)
        except Exception as exc:  # an adapter bug (AdapterExit too) is counted, never fatal
            log.warning("adapter %s failed: %s: %s", op, type(exc).__name__, exc)
            verdict.adapter_errors.append((op, "error"))
            _drop(verdict, DropReason.ADAPTER_ERROR, at_stake)
        return None


def _same_bytes(a: BlockKV, b: BlockKV) -> bool:
    return (a.key.shape == b.key.shape and a.value.shape == b.value.shape
            and bool(torch.equal(a.key, b.key)) and bool(torch.equal(a.value, b.value)))


def _drop(verdict: Verdict, reason: DropReason, n: int = 1) -> None:
    """Record that ``n`` blocks of this sample could not be decided for ``reason``. The
    drop counter counts *samples* (one per reason per sample, however many blocks), so
    ``samples_dropped_total / sampled_total`` is a ratio of like with like."""
    if n > 0:
        verdict.dropped[reason] = 1
