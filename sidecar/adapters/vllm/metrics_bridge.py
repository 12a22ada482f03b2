"""vLLM's own /metrics, re-exported under the sidecar's signal names.

Choice (documented in docs/guides/vllm.md): the bridge *translates* rather than letting
the dashboards join two namings, so the sidecar's dashboards and alert rules work unchanged
for vLLM and for any other engine. The mapping, from vLLM 0.32's Prometheus series:

==========================================  =============================================
vLLM                                        sidecar
==========================================  =============================================
prefix_cache_queries_total (tokens)         query_tokens_total   (only when no probe: with
prefix_cache_hits_total (tokens)            hit_tokens_total      a probe, lookups are
                                                                  counted per request by
                                                                  the Monitor instead)
cache_config_info{num_gpu_blocks}           blocks{state="total"}
kv_cache_usage_perc                         usage_ratio, blocks{state="used"|"free"}
num_preemptions_total                       allocation_failures_total
prompt_tokens - prefix_cache_hits +         allocations_total (estimate: blocks filled =
generation_tokens, / block_size             freshly computed tokens / block size)
num_requests_waiting_by_reason{capacity}    capacity_waiting_requests
e2e_request_latency_seconds (histogram)     request_latency_seconds (re-binned: each vLLM
                                            bucket's new observations are recorded at its
                                            upper bound, so P99 rounds *up* to vLLM's
                                            bucket resolution)
==========================================  =============================================

Why preemptions are the allocation-failure signal: vLLM's scheduler preempts a running
request exactly when ``allocate_slots`` finds no free block for it; requests that cannot be
admitted for lack of KV blocks wait with reason ``capacity``. vLLM's pool is paged with no
contiguity requirement, so every free block is usable: the bridge reports the largest free
run as all free blocks (fragmentation 0 by construction, not by measurement).

Sources: an HTTP URL (the OpenAI server's ``/metrics``) or, in-process, the text of
``prometheus_client.REGISTRY`` where ``vllm.LLM(disable_log_stats=False)`` registers them.
"""

from __future__ import annotations

import logging
import math
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from sidecar import signals as S
from sidecar.core.protocol import AllocatorState
from sidecar.export.log_limit import LimitedWarning
from sidecar.export.metrics import Metrics

log = logging.getLogger(__name__)

LATENCY = "vllm:e2e_request_latency_seconds"


@dataclass
class Scrape:
    """The vLLM series the bridge reads, summed over vLLM's own labels (engine index...)."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    capacity_waiting: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    hash_algo: str | None = None
    latency_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative


def parse_metrics(text: str) -> Scrape:
    """Pick the series the bridge needs out of a Prometheus text exposition."""
    out = Scrape()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if not name.startswith("vllm:"):
                continue
            if name.endswith("_total") and family.type == "counter":
                out.counters[name] = out.counters.get(name, 0.0) + s.value
            elif name == "vllm:num_requests_waiting_by_reason":
                if s.labels.get("reason") == "capacity":
                    out.capacity_waiting = (out.capacity_waiting or 0.0) + s.value
            elif name == "vllm:cache_config_info":
                if s.labels.get("num_gpu_blocks", "None").isdigit():
                    out.num_gpu_blocks = int(s.labels["num_gpu_blocks"])
                if s.labels.get("block_size", "").isdigit():
                    out.block_size = int(s.labels["block_size"])
                out.hash_algo = s.labels.get("prefix_caching_hash_algo") or out.hash_algo
            elif name == LATENCY + "_bucket":
                le = float(s.labels["le"])
                out.latency_buckets[le] = out.latency_buckets.get(le, 0.0) + s.value
            elif family.type == "gauge":
                out.gauges[name] = out.gauges.get(name, 0.0) + s.value
    return out


def http_source(url: str, timeout_s: float = 2.0) -> Callable[[], str]:
    """A source reading ``url`` (loopback ``/metrics`` of the OpenAI server)."""
    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return str(resp.read().decode("utf-8"))
    return fetch


def registry_source() -> Callable[[], str]:
    """A source reading this process's default registry (in-process ``vllm.LLM``)."""
    from prometheus_client import REGISTRY, generate_latest

    return lambda: generate_latest(REGISTRY).decode("utf-8")


class VllmMetricsBridge:
    """Scrapes vLLM and updates ``metrics``; :meth:`poll` returns the allocator state.

    ``lookups``: also translate the prefix-cache token counters (leave False when a probe
    reports lookups to the Monitor, so nothing is counted twice). ``on_latency`` receives
    each re-binned e2e latency (the service passes ``Monitor.on_request_done``, so the
    Monitor's request count and P99 see vLLM's requests); ``None`` skips latency.
    """

    def __init__(self, metrics: Metrics, source: Callable[[], str], block_size: int,
                 lookups: bool = False,
                 on_latency: Callable[[float], None] | None = None,
                 expect_hash_algo: str | None = None) -> None:
        self.metrics = metrics
        metrics.register(S.VLLM_SIGNALS)  # the vLLM adapter's own signals
        self.source = source
        self.block_size = block_size
        self.lookups = lookups
        self.on_latency = on_latency
        self.expect_hash_algo = expect_hash_algo
        self.hash_algo_mismatch = False
        self.last: Scrape | None = None
        self._lock = threading.Lock()
        self.state: AllocatorState | None = None
        metrics.inc(S.ENGINE_SCRAPE_ERRORS, 0)
        self._failed = LimitedWarning(log)

    def poll(self) -> AllocatorState | None:
        """Scrape once; never raises (a failed scrape is counted and logged)."""
        try:
            text = self.source()
            scrape = parse_metrics(text)
        except Exception as exc:
            self.metrics.inc(S.ENGINE_SCRAPE_ERRORS)
            self._failed.warn("reading vLLM metrics failed: %s: %s", type(exc).__name__, exc)
            return self.state
        with self._lock:
            self._apply(scrape)
            self.last = scrape
        return self.state

    def _apply(self, now: Scrape) -> None:
        prev = self.last
        if (self.expect_hash_algo and now.hash_algo and now.hash_algo != self.expect_hash_algo
                and not self.hash_algo_mismatch):
            self.hash_algo_mismatch = True
            log.error("vLLM hashes blocks with %s but the sidecar audits with %s: every "
                      "stored block will be reported as a hash mismatch; pass --hash-algo %s",
                      now.hash_algo, self.expect_hash_algo, now.hash_algo)
        if self.lookups:
            for vllm_name, sig in (("vllm:prefix_cache_queries_total", S.QUERY_TOKENS),
                                   ("vllm:prefix_cache_hits_total", S.HIT_TOKENS)):
                delta = _delta(now.counters.get(vllm_name), prev.counters.get(vllm_name)
                               if prev else None)
                if delta > 0:
                    self.metrics.inc(sig, delta)
        if now.capacity_waiting is not None:
            self.metrics.gauge(S.CAPACITY_WAITING).set(now.capacity_waiting)
        if self.on_latency is not None:
            self._rebin_latency(now, prev, self.on_latency)
        self.state = self._allocator(now)

    def _allocator(self, now: Scrape) -> AllocatorState | None:
        total = now.num_gpu_blocks
        usage = now.gauges.get("vllm:kv_cache_usage_perc")
        if total is None or usage is None:
            return None
        total -= 1  # vLLM's null block is never allocatable; usage is relative to the rest
        used = round(usage * total)
        free = max(0, total - used)
        c = now.counters
        computed = (c.get("vllm:prompt_tokens_total", 0.0)
                    - c.get("vllm:prefix_cache_hits_total", 0.0)
                    + c.get("vllm:generation_tokens_total", 0.0))
        return AllocatorState(
            # vLLM's usage counts cached (evictable) blocks as free: how many is unknown.
            total_blocks=total, free_blocks=free, cached_blocks=None, used_blocks=used,
            largest_free_run=free,
            allocations=math.ceil(max(0.0, computed) / max(1, self.block_size)),
            allocation_failures=int(c.get("vllm:num_preemptions_total", 0.0)))

    @staticmethod
    def _rebin_latency(now: Scrape, prev: Scrape | None,
                       observe: Callable[[float], None]) -> None:
        before = prev.latency_buckets if prev else {}
        if any(v < before.get(le, 0.0) for le, v in now.latency_buckets.items()):
            before = {}  # the engine restarted: its histogram started over
        les = sorted(now.latency_buckets)
        finite = [le for le in les if math.isfinite(le)]
        below = 0.0  # new observations at or below the previous bound
        for le in les:
            new_cum = now.latency_buckets[le] - before.get(le, 0.0)
            n = round(new_cum - below)
            below = new_cum
            value = le if math.isfinite(le) else (2 * finite[-1] if finite else 1e9)
            for _ in range(max(0, n)):
                observe(value)


def _delta(now: float | None, prev: float | None) -> float:
    if now is None:
        return 0.0
    if prev is None or now < prev:  # first scrape, or a restart reset the counter
        return now
    return now - prev
