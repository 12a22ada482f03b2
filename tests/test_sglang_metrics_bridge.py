"""SGLang's own /metrics as the sidecar reads it: only its two series' lines parsed, read on
the bridge's own thread at its own period (never by the allocator poll), and the hit audit
counted from the first read when the sidecar came to a server that had served hits."""

from __future__ import annotations

import time
from typing import Any


def test_metrics_parse_reads_only_its_series_lines() -> None:
    """The bridge hands only its two series' sample lines to the exposition parser (the
    whole page cost ~12 ms per poll): same sums as parsing the whole page, decoys whose
    names only start alike are not counted, and a line the parser would refuse elsewhere
    on the page no longer fails the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    from sidecar.adapters.sglang.metrics_bridge import SERIES, parse

    page = "\n".join([
        "# HELP sglang:cache_hit_rate The prefix cache hit rate.",
        "# TYPE sglang:cache_hit_rate gauge",
        'sglang:cache_hit_rate{engine_type="unified",tp_rank="0"} 0.25',
        'sglang:cache_hit_rate{engine_type="unified",tp_rank="1"} 0.5',
        "# TYPE sglang:cache_hit_rate_hist histogram",
        'sglang:cache_hit_rate_hist_bucket{le="0.5"} 7.0',
        "# TYPE sglang:cached_tokens_total counter",
        'sglang:cached_tokens_total{cache_source="device"} 100.0',
        'sglang:cached_tokens_total{cache_source="host",note="a\\nb"} 20.0',
        'sglang:other{label="sglang:cached_tokens_total 1e9"} 3.0',
        "sglang:cached_tokens_total_by_source 5.0",
    ]) + "\n"
    whole: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name in SERIES:
                whole[sample.name] = whole.get(sample.name, 0.0) + sample.value
    assert parse(page) == whole == {"sglang:cache_hit_rate": 0.75,
                                    "sglang:cached_tokens_total": 120.0}
    assert parse(page + "not a sample line {\n") == whole


def test_metrics_bridge_reads_sglang_on_its_own_thread() -> None:
    """SGLang's /metrics is read by the bridge's thread (at start, then every ``every_s``),
    never by the allocator poll; a sidecar that came to a server which had already served
    hits audits what both sides counted from its first read on."""
    import http.server
    import threading

    from prometheus_client import CollectorRegistry

    from sidecar import signals as S
    from sidecar.adapters.sglang.metrics_bridge import SglangMetricsBridge
    from sidecar.adapters.sglang.service import SglangAdapter
    from sidecar.export.metrics import Metrics

    reads: list[str] = []
    cached = [500.0]  # SGLang served 500 cached tokens before the sidecar came

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            reads.append(self.path)
            body = f"sglang:cached_tokens_total {cached[0]}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    counted = [0]
    try:
        metrics = Metrics("sglang", "m", CollectorRegistry())
        metrics.register(S.SGLANG_SIGNALS)
        bridge = SglangMetricsBridge(metrics, f"http://127.0.0.1:{httpd.server_port}/metrics",
                                     lambda: counted[0], every_s=3600.0)
        waits: list[float] = []
        wait = bridge._stop.wait
        bridge._stop.wait = lambda t=None: waits.append(t) or wait(t)  # type: ignore
        bridge.start()
        deadline = time.monotonic() + 60  # bounds a hang only
        while not waits and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(reads) == 1 and waits == [3600.0]  # read at once, then wait its period
        adapter = SglangAdapter(None, None, bridge)  # type: ignore[arg-type]
        adapter.allocator()
        assert len(reads) == 1  # the allocator poll does not read SGLang's page
        bridge.stop()
        assert bridge._thread is None
        assert bridge.last["discrepancy"] == 0 and bridge.last["cached_before_sidecar"] == 500
        counted[0], cached[0] = 40, 540.0  # both saw the same 40 since
        assert bridge.poll()["discrepancy"] == 0
        cached[0] = 600.0  # SGLang says 60 more that no tap message brought
        assert bridge.poll()["discrepancy"] == 60
    finally:
        httpd.shutdown()
        httpd.server_close()
