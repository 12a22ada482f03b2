"""One vLLM engine watched by one sidecar: the Monitor plus the vLLM-specific feeds.

Wiring, the same whether the sidecar runs beside ``vllm.entrypoints.openai.api_server`` or
in the process that holds a ``vllm.LLM``:

* probe pipe (:class:`.receiver.ProbeReceiver`) -> ``Monitor.on_lookup`` for every lookup
  the probe did not sample, ``Monitor.on_captured`` for the 1-in-N it sampled with the KV it
  copied out at match time (the probe samples: the KV must be copied while the engine still
  holds it) and each block's write record (write path, write-time fingerprint), and the
  probe's fingerprint counts to :class:`.fingerprint_signals.FingerprintSignals`;
* KV event stream (:class:`.subscriber.EventSubscriber`) -> :class:`.audit.EventAuditor`;
* vLLM's own metrics (:class:`.metrics_bridge.VllmMetricsBridge`) -> allocator state and
  latency, polled by the Monitor's allocator poller;
* the Monitor verifies samples with :class:`.adapter.VllmAdapter` on its worker thread or,
  with ``deferred=True`` (the Monitor's deferred dispatch), when the owner calls
  :meth:`VllmSidecar.verify_pending` (needed for the engine reference with an in-process
  ``vllm.LLM``, which only the thread that owns it may drive).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar.adapters.vllm.adapter import (
    VllmAdapter,
    captured_hit,
    captured_writes,
    engine_info_from_checkpoint,
    hello_mismatches,
)
from sidecar.adapters.vllm.audit import EventAuditor
from sidecar.adapters.vllm.fingerprint_signals import FingerprintSignals
from sidecar.adapters.vllm.metrics_bridge import VllmMetricsBridge, http_source
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.reference import EngineReference, HFReference, Submit, http_submit
from sidecar.adapters.vllm.subscriber import EventSubscriber
from sidecar.adapters.vllm.wire import Capture
from sidecar.checks.verifier import Sample, Verdict
from sidecar.config.settings import ENGINE_METRICS_EVERY_S
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import Lookup
from sidecar.core.verdict_listeners import Stage
from sidecar.signals import BurstReason

log = logging.getLogger(__name__)


@dataclass
class VllmSidecarConfig:
    """Where the engine is and how to check it; see docs/guides/vllm.md."""

    model_dir: str
    dtype: str
    block_size: int
    model_name: str | None = None  # the served model name (metric label, API model)
    probe_endpoint: str | None = None  # the sidecar binds it; the probe connects
    events_endpoint: str | None = None  # vLLM's KVEventsConfig.endpoint
    replay_endpoint: str | None = None  # vLLM's KVEventsConfig.replay_endpoint
    events_bind: bool = False  # bind (tcp://127.0.0.1:port endpoints) instead of connect
    hash_algo: str = "sha256"  # vLLM's --prefix-caching-hash-algo
    hash_seed: str | None = None  # the engine's PYTHONHASHSEED, if set
    metrics_url: str | None = None  # vLLM's /metrics (beside the OpenAI server)
    engine_url: str | None = None  # the OpenAI server, for the engine reference
    reference: str = "engine"  # "engine", "hf" or "none"
    deferred: bool = False
    allocator_every_s: float = ENGINE_METRICS_EVERY_S  # reads of vLLM's /metrics
    pending_limit: int = 256
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)


class VllmSidecar:
    def __init__(self, cfg: VllmSidecarConfig, registry: CollectorRegistry | None = None,
                 submit: Submit | None = None,
                 metrics_source: Callable[[], str] | None = None) -> None:
        self.cfg = cfg
        if cfg.events_bind and cfg.probe_endpoint and cfg.events_endpoint and \
                _same_socket(cfg.events_endpoint, cfg.probe_endpoint):
            raise ValueError(f"--events {cfg.events_endpoint} with --events-bind is --probe's "
                             "socket too: the second bind would take it from the first "
                             "(give each its own path or port)")
        info = engine_info_from_checkpoint(cfg.model_dir, cfg.dtype, cfg.block_size,
                                           cfg.model_name)
        self.info = info
        self.adapter = VllmAdapter(info, None)
        # The probe samples (in the engine); the Monitor verifies its captures, queued or,
        # deferred, when the owner asks. It polls the allocator (vLLM's metrics) itself.
        sidecar_cfg = dataclasses.replace(
            cfg.sidecar, allocator_every_s=cfg.allocator_every_s,
            dispatch="deferred" if cfg.deferred else cfg.sidecar.dispatch,
            queue_size=cfg.pending_limit if cfg.deferred else cfg.sidecar.queue_size)
        self.monitor = Monitor(self.adapter, sidecar_cfg, registry, info=info)
        self.metrics = self.monitor.metrics
        source = metrics_source or (http_source(cfg.metrics_url) if cfg.metrics_url else None)
        if source is not None:
            self.adapter.bridge = VllmMetricsBridge(
                self.metrics, source, cfg.block_size, lookups=cfg.probe_endpoint is None,
                on_latency=self.monitor.on_request_done, expect_hash_algo=cfg.hash_algo)
        self.receiver: ProbeReceiver | None = None
        self.fingerprints = FingerprintSignals(self.metrics, info)
        self.monitor.verdict_listeners.add(self.fingerprints.on_verdict, Stage.SIGNALS)
        if cfg.probe_endpoint:
            self.receiver = ProbeReceiver(cfg.probe_endpoint, self.metrics, self._on_lookups,
                                          self._on_capture, self._on_hello,
                                          groups=[g.group_id for g in info.groups],
                                          handlers={"fingerprints": self.fingerprints.on_counts})
        self.adapter.reference = self._make_reference(cfg, submit)
        self.auditor = EventAuditor(self.metrics, cfg.hash_algo, cfg.hash_seed,
                                    groups=[g.group_id for g in info.groups])
        self.subscriber = (EventSubscriber(self.auditor, cfg.events_endpoint,
                                           cfg.replay_endpoint, bind=cfg.events_bind)
                           if cfg.events_endpoint else None)
        self.engine_mismatches: list[str] = []
        self._last_build: str | None = None  # hello_build of the last probe that said hello

    def _make_reference(self, cfg: VllmSidecarConfig, submit: Submit | None) -> Any:
        if cfg.reference == "hf":
            return HFReference(cfg.model_dir, self.info)
        if cfg.reference == "engine":
            if self.receiver is None:
                raise ValueError("the engine reference needs the probe: give --probe "
                                 "(probe_endpoint) or --reference hf")
            if submit is None:
                if not cfg.engine_url:
                    raise ValueError("the engine reference needs vLLM's server to recompute on: "
                                     "give --engine-url (engine_url; in process: a submit()) "
                                     "or --reference hf")
                submit = http_submit(cfg.engine_url, cfg.model_name or cfg.model_dir)
            return EngineReference(self.receiver, submit, cfg.block_size,
                                   timeout_s=0.8 * cfg.sidecar.adapter_timeout_s)
        if cfg.reference == "none":
            return None
        raise ValueError(f"unknown reference {cfg.reference!r}: use engine, hf or none")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VllmSidecar:
        if self.receiver is not None:
            self.receiver.start()
        if self.subscriber is not None:
            self.subscriber.start()
        self.monitor.start()
        return self

    def stop(self) -> None:
        for part in (self.subscriber, self.receiver):
            if part is not None:
                part.stop()
        self.monitor.stop()

    # ------------------------------------------------------------------ probe callbacks
    def _on_lookups(self, items: list[tuple[int, int]]) -> None:
        for q, h in items:
            self.monitor.on_lookup(Lookup(q, h))

    def _on_capture(self, cap: Capture) -> None:
        lookup, blocks = captured_hit(cap)
        self.monitor.on_captured(lookup, blocks, captured_writes(cap))

    def _on_hello(self, hello: dict[str, Any]) -> None:
        # A new probe is a new engine process: its sampler starts a burst, and so does the
        # sidecar's mirror of it; "upgrade" when the version, KV layout or kernel changed.
        build = hello_build(hello)
        if self._last_build is not None:
            self.monitor.outlook.rearm(BurstReason.UPGRADE if build != self._last_build
                                       else BurstReason.RESTART)
        self._last_build = build
        self.engine_mismatches = hello_mismatches(self.info, hello)
        if self.engine_mismatches:
            log.error("the engine is not the one the sidecar was configured for: %s; "
                      "verdicts will be wrong until this is fixed",
                      "; ".join(self.engine_mismatches))
        else:
            log.info("vLLM %s probe connected (%s, %s, block %d)", hello.get("vllm"),
                     hello.get("model"), hello.get("dtype"), hello.get("block_size"))

    # ------------------------------------------------------------------ deferred mode
    def wait_for_samples(self, n: int, timeout_s: float = 10.0) -> bool:
        """Wait until ``n`` samples are pending (deferred mode): the probe sends a capture
        before its request finishes, but it crosses a socket and a thread to get here."""
        return self.monitor.dispatcher.wait_pending(n, timeout_s)

    def quiesce(self, idle_s: float = 0.3, timeout_s: float = 5.0) -> None:
        """Wait until the probe has been silent for ``idle_s`` (at most ``timeout_s``), so
        the samples of requests that just finished have arrived."""
        if self.receiver is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if time.monotonic() - self.receiver.last_message_at >= idle_s:
                return
            time.sleep(idle_s / 3)

    def take_pending(self) -> list[Sample]:
        """The samples kept so far (deferred mode), for the caller to verify with
        ``monitor.verify_sample`` (e.g. against several references)."""
        return self.monitor.dispatcher.take_pending()

    def verify_pending(self) -> list[Verdict]:
        """Verify the samples captured so far, on the calling thread (deferred mode)."""
        self.quiesce()
        return self.monitor.verify_pending()

    def health(self) -> dict[str, Any]:
        """``/healthz``: verifier, probe receiver, event subscriber and poller alive."""
        from sidecar.core.health import monitor_health

        parts: dict[str, Callable[[], bool]] = {}
        if self.receiver is not None:
            parts["probe_receiver_thread"] = lambda: bool(self.receiver and self.receiver.alive)
        if self.subscriber is not None:
            parts["event_subscriber_thread"] = lambda: bool(
                self.subscriber and self.subscriber.alive)
        return monitor_health(self.monitor, parts, verifier=not self.cfg.deferred)

    def summary(self) -> dict[str, Any]:
        out = self.monitor.summary()
        out["events"] = self.auditor.summary()
        out["reference"] = getattr(self.adapter.reference, "name", None)
        out["probe_messages"] = self.receiver.messages if self.receiver else 0
        out["engine_mismatches"] = self.engine_mismatches
        return out


def hello_build(hello: dict[str, Any]) -> str:
    """What identifies the engine's build in a probe's hello: version, KV layout (dtype,
    per-block shape, strides) and cache groups; a change of any of them after a restart is
    an upgrade. (vLLM 0.32 gives a KV connector no name for its attention kernel: a kernel
    change shows only where it changes the layout.)"""
    return repr([hello.get(k) for k in ("vllm", "kv_layout", "block_size",
                                        "kv_heads", "head_dim", "groups", "group_kinds")])


def _same_socket(a: str, b: str) -> bool:
    """Two endpoints that name one socket (ipc paths compared resolved)."""
    if a.startswith("ipc://") and b.startswith("ipc://"):
        return os.path.realpath(a[6:]) == os.path.realpath(b[6:])
    return a == b
