"""What an engine says it did during one timed run, from its own Prometheus ``/metrics``:
counters read before and after, summed over their label sets. The real-engine benches keep
them per run beside wall and CPU time, so a slow run can be told apart by cause: more
engine steps for the same requests (smaller batches), prefix-cache misses (more prefill),
preemptions.
"""

from __future__ import annotations

import urllib.request

VLLM = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "vllm:iteration_tokens_total_count",
        "vllm:iteration_tokens_total_sum", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total")


def read(url: str, names: tuple[str, ...], timeout: float = 10.0) -> dict[str, float]:
    """``names`` from ``url``/metrics, each summed over its label sets; {} when unreadable
    (a figure missing from a run, not a failed bench)."""
    if not names:
        return {}
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return {}
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """After minus before, for the names both read."""
    return {k.removeprefix("vllm:"): round(after[k] - before[k], 3)
            for k in after if k in before}
