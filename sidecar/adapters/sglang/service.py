"""One SGLang server watched by one sidecar: the Monitor fed by the tap's pipe.

* the probe pipe (:class:`sidecar.adapters.vllm.receiver.ProbeReceiver`, the same bounded
  pipe and checks as vLLM's probe) -> ``Monitor.on_lookup`` / ``on_captured`` for lookups
  and sampled hits, ``on_store`` / ``on_free`` for the tree's stores and frees, and the slot
  census -> :mod:`.census` invariants -> the Monitor's allocator health;
* SGLang's ``/metrics`` (optional) -> :mod:`.metrics_bridge`, read every
  ``metrics_every_s`` on the bridge's own thread;
* the Monitor verifies captures against :class:`sidecar.adapters.vllm.reference.HFReference`
  (transformers on the checkpoint directory SGLang serves).

Engine-side recompute: SGLang's requests take a ``cache_salt`` that namespaces the radix
tree (``RadixKey.cache_salt``), so a salted ``/generate`` cannot hit the cache: the same
trick as vLLM's engine reference would work. It is not wired yet; the HF reference is.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.adapters.sglang.census import Census, check_census, decode_census
from sidecar.adapters.sglang.metrics_bridge import SglangMetricsBridge
from sidecar.adapters.vllm.adapter import (
    captured_hit,
    engine_info_from_checkpoint,
    hello_mismatches,
)
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.wire import Capture, WireError, decode_key_fields
from sidecar.checks.verifier import Verdict
from sidecar.config.settings import ENGINE_METRICS_EVERY_S
from sidecar.core.hook_input import check_lookup
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import (
    AdapterError,
    AllocatorState,
    BlockKV,
    BlockRef,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
    Lookup,
    StoredBlock,
)

log = logging.getLogger(__name__)

SGLANG_KEY_FIELDS = ("extra_key", "cache_salt")  # what RadixKey namespaces by
MAX_STORES = 65_536  # per message
MAX_TRACKED = 1 << 22  # stored block ids kept for freed_blocks (a few hundred MB at most)


@dataclass
class SglangSidecarConfig:
    model_dir: str
    dtype: str
    block_size: int = 16
    probe_endpoint: str = ""
    metrics_url: str | None = None
    reference: str = "hf"  # "hf" or "none"
    deferred: bool = False
    allocator_every_s: float = 2.0
    metrics_every_s: float = ENGINE_METRICS_EVERY_S  # reads of SGLang's /metrics (metrics_bridge)
    sidecar: SidecarConfig = field(default_factory=SidecarConfig)


def engine_info(model_dir: str, dtype: str, block_size: int) -> EngineInfo:
    """What SGLang serving ``model_dir`` caches: one full-attention group, or for a hybrid
    SWA checkpoint (sliding-window and full-attention layers) the two groups the tap reads
    from SGLang's two pools, numbered in order of each kind's first layer; SGLang's padding
    slot 0 is every group's null block. Other layer kinds (recurrent state) are refused."""
    base = engine_info_from_checkpoint(model_dir, dtype, block_size)
    kinds = {g.kind for g in base.groups}
    if kinds == {GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW}:
        groups = base.groups
    elif kinds - {GroupKind.FULL_ATTENTION}:
        raise ValueError(f"{model_dir}: kv-sidecar's SGLang adapter verifies full-attention "
                         f"and sliding-window models, not {sorted(k.value for k in kinds)}")
    else:
        layers = tuple(sorted({i for g in base.groups for i in g.layers}))
        groups = (CacheGroup(0, GroupKind.FULL_ATTENTION, layers, name="full"),)
    return dataclasses.replace(base, engine="sglang", key_fields=SGLANG_KEY_FIELDS,
                               groups=groups)


class SglangAdapter:
    """The Monitor's view of SGLang: captures come in at match time (``reread = False``),
    the allocator state from the last slot census."""

    reread = False
    reference_kind = "independent"

    def __init__(self, info: EngineInfo, reference: Any | None,
                 bridge: SglangMetricsBridge | None = None) -> None:
        self.info = info
        self.reference = reference
        self.bridge = bridge
        self.census: Census | None = None
        self.alloc_failures = 0

    def describe(self) -> EngineInfo:
        return self.info

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        raise AdapterError("SGLang slots are only read at match time, by the tap")

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        if self.reference is None:
            raise AdapterError("no recompute reference configured")
        return list(self.reference.recompute(hit, refs))

    def allocator(self) -> AllocatorState | None:
        c = self.census
        if c is None:
            return None
        return dataclasses.replace(c.state(), allocation_failures=self.alloc_failures)


class SglangSidecar:
    def __init__(self, cfg: SglangSidecarConfig,
                 registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.info = engine_info(cfg.model_dir, cfg.dtype, cfg.block_size)
        self.adapter = SglangAdapter(self.info, None)
        # The tap's stores and frees name full-pool slots (the tree's own values); the
        # sliding group's SWA slots are named only by the hits that serve them.
        self.full_group = next(g.group_id for g in self.info.groups
                               if g.kind is GroupKind.FULL_ATTENTION)
        # --reference none: no recompute asked for (not one refused per sampled hit, each
        # an adapter error and a warning: an outside check saw 4,773 lines in 90 s)
        sidecar_cfg = dataclasses.replace(
            cfg.sidecar, allocator_every_s=cfg.allocator_every_s,
            recompute=cfg.sidecar.recompute and cfg.reference != "none",
            dispatch="deferred" if cfg.deferred else cfg.sidecar.dispatch)
        self.monitor = Monitor(self.adapter, sidecar_cfg, registry, info=self.info)
        self.metrics = self.monitor.metrics
        self.metrics.register(S.SGLANG_SIGNALS)
        self.counted_hit_tokens = 0
        self.tap_errors = 0  # the taps' own errors and time on SGLang's thread, summed
        self.tap_seconds = 0.0
        self._clock = time.monotonic  # when a tap's stats arrive (tests set their own)
        # src -> (errors, busy_ns credited, when): see _on_tap_stats
        self._taps: dict[str, tuple[int, int, float]] = {}
        self.census_checks = 0
        self.freed_blocks = 0  # stored blocks the tap saw freed (evicted)
        # Ids stored and not yet freed (at most MAX_TRACKED): a free counts in freed_blocks
        # only for one of them (an outside check drove it with ids never stored).
        self._stored: set[int] = set()
        self.engine_mismatches: list[str] = []
        if cfg.metrics_url:
            self.adapter.bridge = SglangMetricsBridge(
                self.metrics, cfg.metrics_url, lambda: self.counted_hit_tokens,
                every_s=cfg.metrics_every_s)
        if cfg.reference == "hf":
            from sidecar.adapters.vllm.reference import HFReference

            self.adapter.reference = HFReference(cfg.model_dir, self.info)
        elif cfg.reference != "none":
            raise ValueError(f"unknown reference {cfg.reference!r}: use hf or none")
        self.receiver = ProbeReceiver(
            cfg.probe_endpoint, self.metrics, self._on_lookups, self._on_capture,
            self._on_hello, groups=[g.group_id for g in self.info.groups],
            handlers={"stores": self._on_stores, "frees": self._on_frees,
                      "census": self._on_census, "alloc_failed": self._on_alloc_failed,
                      "tap_stats": self._on_tap_stats})

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SglangSidecar:
        self.receiver.start()
        self.monitor.start()
        if self.adapter.bridge is not None:
            self.adapter.bridge.start()
        return self

    def stop(self) -> None:
        if self.adapter.bridge is not None:
            self.adapter.bridge.stop()
        self.receiver.stop()
        self.monitor.stop()

    # ------------------------------------------------------------------ tap messages
    def _on_lookups(self, items: list[tuple[int, int]]) -> None:
        for q, h in items:
            lookup = Lookup(q, h)
            if check_lookup(lookup) is None:  # what the Monitor refuses is no hit either
                self.counted_hit_tokens += h
            self.monitor.on_lookup(lookup)

    def _on_capture(self, cap: Capture) -> None:
        lookup, blocks = captured_hit(cap)
        self.counted_hit_tokens += cap.hit_tokens
        self.monitor.on_captured(lookup, blocks)

    def _on_stores(self, msg: dict[str, Any]) -> None:
        items = msg.get("items")
        if not isinstance(items, list) or len(items) > MAX_STORES:
            raise WireError("stores is not a bounded list")
        for item in items:
            if not isinstance(item, list) or len(item) != 5:
                raise WireError("a store is not [block, prefix, tokens, digest, fields]")
            block_id, lo, tokens, digest, fields = item
            self.monitor.on_store(StoredBlock(
                self.full_group, block_id, 0,
                tuple(tokens) if isinstance(tokens, list) else tokens, lo,
                decode_key_fields(fields),  # a capture's rule: a small map of short strings
                prefix_digest=digest))
            if type(block_id) is int and len(self._stored) < MAX_TRACKED:
                self._stored.add(block_id)

    def _on_frees(self, msg: dict[str, Any]) -> None:
        ids = msg.get("ids")
        if not isinstance(ids, list):
            raise WireError("frees is not a list")
        known = {i for i in ids if type(i) is int and i in self._stored}
        self._stored.difference_update(known)
        self.freed_blocks += len(known)
        self.monitor.on_free(self.full_group, ids)

    def _on_alloc_failed(self, msg: dict[str, Any]) -> None:
        n = msg.get("n")
        if type(n) is int and 0 < n <= 1 << 20:
            self.adapter.alloc_failures += n

    def _on_census(self, msg: dict[str, Any]) -> None:
        census = decode_census(msg)
        self.adapter.census = census
        self.census_checks += 1
        self.monitor.allocator_health.observe_found(
            "sglang_census", check_census(census), self.monitor.requests_done)

    def _on_tap_stats(self, msg: dict[str, Any]) -> None:
        """A tap's cumulative error count and time on SGLang's thread, per sending tap
        (``src``: each tap instance has its own, at random). Errors move by what grew (a
        count that went back, a restarted tap, from 0 again). The time is a cost figure a
        peer on the probe socket must not be able to inflate: the first stats of a tap set
        its baseline, a count that went back sets it again, and what grew is credited at
        most as fast as wall time passes (one thread cannot spend more; what a burst of
        queued messages could not credit yet is credited by the next ones). Replaying,
        lowering and raising a count, or rotating senders, gains nothing past that. Bounded:
        one entry per tap, the oldest forgotten past 64."""
        errors, busy_ns, src = msg.get("errors"), msg.get("busy_ns"), str(msg.get("src"))
        if not (type(errors) is int and type(busy_ns) is int and 0 <= errors < 1 << 62
                and 0 <= busy_ns < 1 << 62):
            raise WireError("tap_stats: errors and busy_ns must be ints in [0, 2**62)")
        now = self._clock()
        last = self._taps.pop(src, None)
        last_errors, credited, since = (0, busy_ns, now) if last is None else last
        if errors < last_errors:
            last_errors = 0
        if errors > last_errors:
            self.metrics.inc(S.HOOK_ERRORS, errors - last_errors, hook="sglang_tap")
            self.tap_errors += errors - last_errors
        if busy_ns < credited:
            credited = busy_ns
        grant = min(busy_ns - credited, int((now - since) * 1e9))
        if grant > 0:
            self.metrics.inc(S.SGLANG_TAP_SECONDS, grant / 1e9)
            self.tap_seconds += grant / 1e9
            credited += grant
        self._taps[src] = (errors, credited, now)
        while len(self._taps) > 64:
            self._taps.pop(next(iter(self._taps)))

    def _on_hello(self, hello: dict[str, Any]) -> None:
        self.engine_mismatches = hello_mismatches(self.info, hello)
        if self.engine_mismatches:
            log.error("the SGLang server is not the one the sidecar was configured for: %s",
                      "; ".join(self.engine_mismatches))
        else:
            log.info("SGLang %s tap connected (%s, %s, block %d, %s slots)",
                     hello.get("sglang"), hello.get("model"), hello.get("dtype"),
                     hello.get("block_size"), hello.get("slots"))

    # ------------------------------------------------------------------ tests, CLI
    def quiesce(self, idle_s: float = 0.5, timeout_s: float = 10.0) -> None:
        """Wait until the tap has been silent for ``idle_s`` since this call, or since its
        last message if later (at most ``timeout_s``): the tap's shipper sends what SGLang
        handed it within its period (0.25 s), so events of a request that has answered are
        in by then."""
        called = time.monotonic()
        deadline = called + timeout_s
        while time.monotonic() < deadline:
            if time.monotonic() - max(self.receiver.last_message_at, called) >= idle_s:
                return
            time.sleep(idle_s / 3)

    def verify_pending(self) -> list[Verdict]:
        self.quiesce()
        return self.monitor.verify_pending()

    def summary(self) -> dict[str, Any]:
        out = self.monitor.summary()
        out["probe_messages"] = self.receiver.messages
        out["bad_probe_messages"] = self.receiver.bad_messages
        out["engine_mismatches"] = self.engine_mismatches
        out["census_checks"] = self.census_checks
        out["freed_blocks"] = self.freed_blocks
        out["counted_hit_tokens"] = self.counted_hit_tokens
        out["tap_seconds"] = round(self.tap_seconds, 6)
        out["tap_errors"] = self.tap_errors
        if self.adapter.bridge is not None:
            out["sglang_metrics"] = self.adapter.bridge.last
        return out
