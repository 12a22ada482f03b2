"""The table rows of a real-engine bench (``bench perf --engine vllm|sglang``): for one
configuration against "off", tokens/s by wall time (with its target, where the issue sets
one), request P50 and P99, and the CPU seconds of each process group against the engine's
own off; every figure the median over interleaved pairs, spread min..max
(:func:`kvtestbed.bench.perf_servers.interleaved_rounds` measured them)."""

from __future__ import annotations

import statistics
from typing import Any

from kvtestbed.bench.perf_row import Row


def _spread(s: dict[str, float]) -> str:
    return f"{s['min']:.3g}..{s['max']:.3g} (ratio)"


# A ratio target is judged only on a host that held steady: the engine's own "off" runs,
# the same work each round, within this factor of each other (max / min over the pairs).
# A recording whose off runs varied 3.6x (load 37 on 2 cores) said "met" at 1.22.
STEADY_OFF = 1.25


def off_variation(rounds: list[dict[str, Any]]) -> float:
    """max / min of the off runs' tokens/s over the rounds (1.0: perfectly steady)."""
    offs = [rd["runs"]["off"]["tokens_per_s"] for rd in rounds]
    return max(offs) / min(offs) if offs and min(offs) > 0 else float("inf")


def pair_rows(res: dict[str, Any], name: str, ratios: dict[str, Any], title: str,
              engine: str, engine_label: str, target: float | None,
              sidecar: bool = True) -> list[Row]:
    """``name``: the configuration's runs in ``res["rounds"]``; ``ratios``: its per-pair
    ratios; ``title``: the rows' label (e.g. "vLLM probe + events 1 in 100"); ``engine``:
    the engine's role in the CPU figures, ``engine_label`` its name in words; ``sidecar``:
    whether the configuration runs the sidecar (its CPU row)."""
    rounds = res["rounds"]

    def med(config: str, metric: str) -> float:
        return statistics.median(rd["runs"][config][metric] for rd in rounds)

    def med_cpu(config: str, role: str) -> float:
        return statistics.median(rd["runs"][config]["cpu_s"].get(role, 0.0) for rd in rounds)

    t = ratios["tokens_per_s"]
    varied = off_variation(rounds)
    steady = varied <= STEADY_OFF
    out = [Row(f"{title} vs off: tokens/s by wall time", med(name, "tokens_per_s"),
               med("off", "tokens_per_s"), "tok/s", t["median"],
               f">= {target:g}" if target else "-",
               (t["median"] >= target if steady else None) if target else None,
               _spread(t) + ("" if steady else f"; not judged: off varied {varied:.2f}x "
                             f"over the pairs (a steady host: <= {STEADY_OFF:g}x)"))]
    for key, label in (("p50", "P50"), ("p99", "P99")):
        out.append(Row(f"{title} vs off: request {label} latency",
                       med(name, f"{key}_s") * 1e3, med("off", f"{key}_s") * 1e3, "ms",
                       ratios[key]["median"], "-", None, _spread(ratios[key])))
    out += thread_rows(rounds, name, title, engine_label)
    out += step_rows(rounds, name, title, engine_label)
    roles = [(engine, f"{engine_label}'s processes")]
    if sidecar:
        roles.append(("sidecar", "the sidecar's process"))
    for role, label in roles:
        s = ratios[f"{role}_cpu"]
        out.append(Row(f"{title} vs off: CPU seconds of {label} per run, vs {engine_label}'s "
                       "off", med_cpu(name, role), med_cpu("off", engine), "CPU s",
                       s["median"], "-", None, _spread(s)))
    return out


THREAD_ROWS = 3  # the engine's threads shown, those whose CPU per request grew most


def thread_rows(rounds: list[dict[str, Any]], name: str, title: str,
                engine_label: str) -> list[Row]:
    """Where the engine's extra CPU went: per thread of its processes (by process and thread
    name, :func:`kvtestbed.bench.proc_cost.group_threads_cpu_s`), the CPU microseconds per
    request with the configuration on against off, medians over the pairs, for the
    :data:`THREAD_ROWS` threads that grew most. Absent for runs recorded without them."""
    if not all("threads_cpu_s" in rd["runs"][c] for rd in rounds for c in (name, "off")):
        return []

    def per_request(config: str, thread: str) -> float:
        return statistics.median(rd["runs"][config]["threads_cpu_s"].get(thread, 0.0)
                                 / max(rd["runs"][config]["requests"], 1) for rd in rounds)

    threads = {t for rd in rounds for c in (name, "off") for t in rd["runs"][c]["threads_cpu_s"]}
    # Threads that used any CPU only: where every busy thread shrank (a short run, /proc's
    # 10 ms ticks), idle ones at 0 would otherwise rank first and leave no row.
    figures = [(per_request(name, t), per_request("off", t), t) for t in threads]
    busy = [f for f in figures if f[0] > 0 or f[1] > 0]
    grown = sorted(busy, key=lambda x: x[1] - x[0])[:THREAD_ROWS]
    return [Row(f"{title} vs off: {engine_label} thread {t!r}, CPU per request", on * 1e6,
                off * 1e6, "us", on / off if off > 0 else None, "-", None,
                f"{(on - off) * 1e6:+.0f} us/request")
            for on, off, t in grown]


STEPS = "iteration_tokens_total_count"  # vLLM's engine steps (its iteration-tokens histogram)
SMALL_BATCHES = 1.5  # a run with more steps than this times off's median: small batches


def step_rows(rounds: list[dict[str, Any]], name: str, title: str,
              engine_label: str) -> list[Row]:
    """The engine's steps per request (from its own /metrics, kept per run by
    :mod:`kvtestbed.bench.engine_counters`), on against off, and how many runs of each ran
    in small batches (more than :data:`SMALL_BATCHES` times off's median steps for the same
    requests): on a saturated host vLLM can fall into a state where it steps one request at
    a time, taking 3-7x the steps and the time, and a run there says nothing about the
    per-request cost being compared. Absent for engines or runs without the count."""
    def steps(config: str) -> list[float]:
        return [rd["runs"][config].get("engine_counters", {}).get(STEPS, 0.0)
                / max(rd["runs"][config]["requests"], 1) for rd in rounds]

    on, off = steps(name), steps("off")
    if not all(on) or not all(off):
        return []
    cut = SMALL_BATCHES * statistics.median(off)
    return [Row(f"{title} vs off: {engine_label} engine steps per request",
                statistics.median(on), statistics.median(off), "steps",
                statistics.median(on) / statistics.median(off), "-", None,
                f"runs in small batches (> {SMALL_BATCHES:g}x off's median steps): "
                f"{sum(x > cut for x in on)} of {len(on)} {name}, "
                f"{sum(x > cut for x in off)} of {len(off)} off")]
