"""SGLang's own ``/metrics`` (``--enable-metrics``), re-exported and audited.

SGLang 0.5.23 exports no integrity signal; what the sidecar takes from it:

==========================================  =============================================
SGLang                                      sidecar
==========================================  =============================================
sglang:cache_hit_rate (gauge)               sglang_cache_hit_rate (as scraped; SGLang
                                            overwrites it per prefill batch, so it is the
                                            last batch's share, not a rate)
sglang:cached_tokens_total (all sources)    sglang_cached_tokens, and
                                            sglang_hit_tokens_discrepancy = |it - the hit
                                            tokens the tap counted| (the audit)
==========================================  =============================================

Slot counts (``sglang:kv_used_tokens``, ``kv_evictable_tokens``, ``kv_available_tokens``)
are not re-exported: the tap's census reads the same structures directly, and the
sidecar's ``blocks{state}`` / ``usage_ratio`` come from it.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from sidecar import signals as S
from sidecar.config.settings import ENGINE_METRICS_EVERY_S
from sidecar.export.log_limit import LimitedWarning
from sidecar.export.metrics import Metrics

log = logging.getLogger(__name__)


SERIES = ("sglang:cache_hit_rate", "sglang:cached_tokens_total")


def parse(text: str) -> dict[str, float]:
    """The SGLang series the bridge reads, summed over SGLang's labels.

    Only the sample lines of those series are handed to the (pure-Python) exposition
    parser: SGLang 0.5.23's page is ~620 lines / 78 KB, and parsing all of it took ~12 ms of
    the sidecar's CPU per poll against ~0.15 ms for the few lines read (a sample line
    cannot span lines: the format escapes newlines in label values)."""
    kept = [line for line in text.splitlines() if line.startswith(SERIES)]
    out: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(kept) + "\n"):
        for sample in family.samples:
            if sample.name in SERIES:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out



class SglangMetricsBridge:
    """Reads SGLang's /metrics every ``every_s`` on a thread of its own (:meth:`start`), so
    a slow page never holds up the allocator poll, and the audit compares what both sides
    counted since the bridge's first read when the sidecar came to a server that had already
    served hits (SGLang's counter then holds hits no tap message will ever bring)."""

    def __init__(self, metrics: Metrics, url: str, counted: Callable[[], int],
                 timeout_s: float = 2.0, every_s: float = ENGINE_METRICS_EVERY_S) -> None:
        self.metrics = metrics
        self.url = url
        self.counted = counted
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.last: dict[str, Any] = {}
        self._base: float | None = None  # SGLang's cached tokens before the sidecar counted
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = LimitedWarning(log)

    def start(self) -> None:
        """Read now, then every :attr:`every_s` until :meth:`stop`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="kvsidecar-sglang-metrics")
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            try:
                self.poll()
            except Exception:  # the thread outlives any one read
                log.exception("reading SGLang's metrics failed")
            if self._stop.wait(self.every_s):
                return

    def poll(self) -> dict[str, Any]:
        """Read SGLang's /metrics now: re-export its hit series and audit them against the
        hit tokens the tap counted."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
                text = resp.read().decode("utf-8", "replace")
            series = parse(text)
        except Exception as exc:
            self.metrics.inc(S.ENGINE_SCRAPE_ERRORS)
            self._failed.warn("cannot read SGLang's metrics at %s: %s", self.url, exc)
            return self.last
        counted = self.counted()
        cached = series.get("sglang:cached_tokens_total", 0.0)
        if self._base is None:  # the first read: hits from before the sidecar counted any
            self._base = cached if counted == 0 else 0.0
        if "sglang:cache_hit_rate" in series:
            self.metrics.gauge(S.SGLANG_CACHE_HIT_RATE).set(series["sglang:cache_hit_rate"])
        self.metrics.gauge(S.SGLANG_CACHED_TOKENS).set(cached)
        discrepancy = abs(cached - self._base - counted)
        self.metrics.gauge(S.SGLANG_HIT_TOKENS_DISCREPANCY).set(discrepancy)
        self.last = {"cache_hit_rate": series.get("sglang:cache_hit_rate"),
                     "cached_tokens": cached, "counted_hit_tokens": counted,
                     "cached_before_sidecar": self._base, "discrepancy": discrepancy}
        return self.last
