"""The sidecar's side of the probe's write-time fingerprints: the three probe signals.

The probe (:mod:`.block_writes`) fingerprints blocks in the engine and reports how many, per
group and write path, in ``fingerprints`` messages; the check itself is the verifier's
fingerprint stage (a mismatch is a ``fingerprint_mismatch`` anomaly), whose outcome per
block is on the verdict. This module turns both into series:

* ``probe_blocks_fingerprinted_total{group, path}`` and ``probe_fingerprint_evictions_total``
  from the probe's counts (a peer's claim: bounded per message by the wire decoder);
* ``probe_fingerprint_checks_total{group, result}`` from each verdict: ``match`` and
  ``mismatch`` where the digest was compared, ``missing`` for a captured block of a
  fingerprinted (attention) group that had none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar import signals as S
from sidecar.adapters.vllm.signals import FingerprintResult
from sidecar.adapters.vllm.wire import decode_fingerprint_counts
from sidecar.core.protocol import EngineInfo, GroupKind
from sidecar.export.metrics import Metrics


class FingerprintSignals:
    """Counts for one vLLM sidecar (see the module docstring)."""

    def __init__(self, metrics: Metrics, info: EngineInfo) -> None:
        self.metrics = metrics
        metrics.register(S.VLLM_SIGNALS)  # the vLLM adapter's own signals
        self.labels = {g.group_id: g.label for g in info.groups}
        # What the probe fingerprints: every group but a recurrent state's.
        self.fingerprinted = {g.group_id for g in info.groups
                              if g.kind is not GroupKind.RECURRENT_STATE}

    def on_counts(self, msg: Mapping[str, Any]) -> None:
        """A ``fingerprints`` message from the probe (malformed: WireError, counted by the
        receiver as a bad message)."""
        blocks, evictions = decode_fingerprint_counts(msg)
        for group_id, path, n in blocks:
            label = self.labels.get(group_id)
            if label is not None and n:
                self.metrics.inc(S.PROBE_BLOCKS_FINGERPRINTED, n, group=label, path=path)
        if evictions:
            self.metrics.inc(S.PROBE_FINGERPRINT_EVICTIONS, evictions)

    def on_verdict(self, verdict: Any) -> None:
        """A reported verdict (a :class:`sidecar.checks.verifier.Verdict`)."""
        sample = verdict.sample
        for ref in sample.captured or {}:
            if ref.group_id not in self.fingerprinted:
                continue
            matched = verdict.fingerprints.get(ref)
            write = sample.writes.get(ref)
            if matched is None and write is not None and write.kv_digest is not None:
                continue  # condemned before the fingerprint stage: not a check
            result = FingerprintResult.MISSING if matched is None \
                else FingerprintResult.MATCH if matched else FingerprintResult.MISMATCH
            self.metrics.inc(S.PROBE_FINGERPRINT_CHECKS, group=self.labels[ref.group_id],
                             result=result.value)
