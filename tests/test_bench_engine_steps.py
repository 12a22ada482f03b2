"""What the real-engine benches keep of the engine's own account of each run
(``kvtestbed.bench.engine_counters``, read from its /metrics) and the row that uses it:
vLLM's engine steps per request, and how many runs of each configuration fell into small
batches (vLLM stepping one request at a time: the "episodes" of docs/bench/perf.md, which a
read of vLLM's /metrics every 2 s brought on)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kvtestbed.bench import engine_counters
from kvtestbed.bench.perf_pair_rows import SMALL_BATCHES, STEPS, step_rows

PAGE = """# HELP vllm:iteration_tokens_total Number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 700.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 20.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 9000.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} not-a-number
"""


@pytest.fixture
def metrics_url() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = PAGE.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_counters_are_summed_over_labels_and_a_bad_value_is_skipped(metrics_url: str) -> None:
    got = engine_counters.read(metrics_url, engine_counters.VLLM)
    assert got["vllm:iteration_tokens_total_count"] == 720.0  # both engines
    assert got["vllm:num_preemptions_total"] == 3.0
    assert got["vllm:prefix_cache_hits_total"] == 0.0  # its one line unparsable: skipped
    assert got["vllm:generation_tokens_total"] == 0.0  # absent from the page
    before = {**got, "vllm:iteration_tokens_total_count": 20.0}
    assert engine_counters.delta(before, got)["iteration_tokens_total_count"] == 700.0


def test_an_unreadable_engine_gives_no_figures_not_a_failed_bench() -> None:
    assert engine_counters.read("http://127.0.0.1:9", engine_counters.VLLM, timeout=2) == {}
    assert engine_counters.read("http://127.0.0.1:9", ()) == {}


def _rounds(off: list[float], on: list[float]) -> list[dict[str, Any]]:
    def run(steps: float) -> dict[str, Any]:
        return {"requests": 600, "engine_counters": {STEPS: steps}}
    return [{"runs": {"off": run(a), "on": run(b)}} for a, b in zip(off, on, strict=True)]


def test_runs_in_small_batches_are_counted_per_configuration() -> None:
    off = [700, 690, 4133, 710, 705]  # one off run fell in too
    on = [716, 2756, 2237, 1140, 704]
    [row] = step_rows(_rounds(off, on), "on", "vLLM probe", "vLLM")
    assert row.sidecar == pytest.approx(1140 / 600) and row.baseline == pytest.approx(705 / 600)
    cut = SMALL_BATCHES * 705 / 600
    assert sum(x / 600 > cut for x in on) == 3
    assert row.spread.endswith("3 of 5 on, 1 of 5 off"), row.spread


def test_no_row_without_the_count() -> None:
    rounds = _rounds([700, 700], [700, 700])
    del rounds[1]["runs"]["on"]["engine_counters"]
    assert step_rows(rounds, "on", "x", "vLLM") == []
