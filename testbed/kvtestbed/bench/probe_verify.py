"""Fuzzed probe captures go through a real verifier, not a no-op callback.

The vLLM adapter's path for a capture the probe sent: :func:`captured_hit` turns it into a
lookup and its blocks, :meth:`Monitor.on_captured` samples, verifies (inline: on this
thread) and reports it. Each delivered capture must be accounted for by the monitor: a
lookup counted (then verified, or dropped with a reason, or a block id rejected), or
rejected as bad input. The
adapter has no reference model here (``reference=None``): the content, shape, dtype and
coverage checks run, the recompute is a counted drop.
"""

from __future__ import annotations

from typing import Any

from sidecar import signals as S


class CaptureVerifier:
    """``on_capture`` for :class:`ProbeReceiver`: a real Monitor over a vLLM adapter
    shaped like the fuzz corpus's engine (float32, block 4, 1 KV head of dim 2, 2 layers)."""

    def __init__(self) -> None:
        from sidecar.adapters.vllm.adapter import VLLM_KEY_FIELDS, VllmAdapter
        from sidecar.core.monitor import Monitor, SidecarConfig
        from sidecar.core.protocol import CacheGroup, EngineInfo, GroupKind

        info = EngineInfo(engine="vllm", model="fuzz", revision="local", dtype="float32",
                          block_size=4, num_kv_heads=1, head_dim=2,
                          groups=(CacheGroup(0, GroupKind.FULL_ATTENTION, (0, 1)),),
                          key_fields=VLLM_KEY_FIELDS)
        self.monitor = Monitor(VllmAdapter(info, None),
                               SidecarConfig(sample_every=1, dispatch="inline",
                                             adapter_timeout_s=1.0,
                                             allocator_check_min_interval_s=-1), info=info)
        self.delivered = 0
        self.unaccounted = 0
        self.escaped = 0

    def _tally(self) -> float:
        m = self.monitor.metrics
        return m.value(S.LOOKUPS.name) + m.value_sum(S.HOOK_INPUT_REJECTED.name) \
            + m.value_sum(S.HOOK_ERRORS.name)

    def __call__(self, cap: Any) -> None:
        from sidecar.adapters.vllm.adapter import captured_hit, captured_writes

        self.delivered += 1
        before = self._tally()
        try:
            self.monitor.on_captured(*captured_hit(cap), captured_writes(cap))
        except Exception:
            self.escaped += 1  # on_captured never raises: this is a bug the fuzz found
            return
        # At least once: a lookup counted, then maybe a block id rejected as well (a
        # negative or absurd id in the block table is counted on top of the lookup).
        if self._tally() <= before:
            self.unaccounted += 1

    def figures(self) -> dict[str, Any]:
        m = self.monitor.metrics
        return {"captures": self.delivered, "verified": m.value_sum(S.VERIFIED.name),
                "sampled": m.value(S.SAMPLED.name),
                "dropped": m.value_sum(S.SAMPLES_DROPPED.name),
                "anomalies": m.value_sum(S.ANOMALIES.name)}
