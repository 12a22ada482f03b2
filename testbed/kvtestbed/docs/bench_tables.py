"""Benchmark tables rendered from the JSON a recorded run stored (``docs/bench/NAME.json``).

Each region starts with what produced its numbers: the command, how much of the full run it
is, the machine, the commit and the date. The tables are the benches' own renderers where they
have one (``kvtestbed.bench.tables``, ``kvtestbed.bench.perf.format_table``), so the page and
the terminal show the same figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtestbed.docs.bench_record import BENCH_DIR, BENCHES
from kvtestbed.docs.code_tables import md_table


def load(root: Path, name: str) -> dict[str, Any] | None:
    path = root / BENCH_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def provenance(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    # Recordings before the recorder took it first have the load at the end of the run.
    at, load_avg = next(((w, m[k]) for w, k in (("start", "load_at_start"),
                                                ("the end", "load_at_end")) if k in m),
                        ("start", None))
    loaded = f", load average {load_avg:.1f} at {at}" if load_avg is not None else ""
    verdict = ("exit 0" if doc["exit_code"] == 0
               else f"**exit {doc['exit_code']}: a check of this run failed**")
    return "\n".join([
        f"!!! note \"Recorded run ({doc['scope'].split(':')[0]})\"",
        f"    `{doc['command']}` — {doc['scope']}.",
        f"    Run {doc['date']} at commit `{doc['commit']}`, {doc['seconds']:.0f} s, {verdict}; "
        f"{m['cpu']}, {m['cores']} cores{loaded}; Python {m['python']}, torch {m['torch']}.",
        f"    Re-record: `python -m kvtestbed.docs bench {doc['bench']}`.", ""])


def _missing(name: str) -> str:
    return (f"Not recorded yet: `python -m kvtestbed.docs bench {name}` runs "
            f"`kv-sidecar {' '.join(BENCHES[name].args)}` and stores its JSON.")


def detection(root: Path, name: str = "detection") -> str:
    doc = load(root, name)
    if doc is None:
        return _missing(name)
    from kvtestbed.bench.tables import render

    problems = doc["result"].get("problems") or []
    tail = ("\n\nProblems the run reported: " + "; ".join(map(str, problems))) if problems \
        else "\n\nThe run reported no problem (no miss, no false alarm, no short clean run)."
    return provenance(doc) + "\n" + render(doc["result"]) + tail


def _rows(root: Path, name: str, tail: Any) -> str:
    """A recorded ``bench perf`` run's rows, rendered as the terminal table; ``tail``: the
    line under it, from the run's settings."""
    doc = load(root, name)
    if doc is None:
        return _missing(name)
    from kvtestbed.bench.perf import format_table
    from kvtestbed.bench.perf_row import Row

    rows = [Row(**r) for r in doc["result"]["rows"]]
    return provenance(doc) + "\n" + format_table(rows) + "\n\n" + tail(doc["result"]["settings"])


def perf(root: Path) -> str:
    return _rows(root, "perf", lambda s: f"Medians of {s['repeats']} repeat(s); spread = min..max.")


def perf_vllm(root: Path) -> str:
    return _rows(root, "perf-vllm", lambda s: (
        f"Medians of {s['pairs']} interleaved pair(s) of {s['requests_per_run']} requests; "
        f"spread = min..max over pairs; load average {s['load_average_start']} at start, "
        f"{s['load_average_end']} at the end."))


def perf_sglang(root: Path) -> str:
    def tail(s: dict[str, Any]) -> str:
        out = (f"Medians of {s['pairs']} interleaved pair(s) of {s['requests_per_run']} "
               f"requests; spread = min..max over pairs; load average "
               f"{s['load_average_start']} at start, {s['load_average_end']} at the end.")
        if s.get("canary_failed"):
            out += (f"\n\nSGLang's `--kv-canary` did not start on this machine, so it has no "
                    f"row: `{s['canary_failed']}`.")
        return out

    return _rows(root, "perf-sglang", tail)


def reliability(root: Path) -> str:
    doc = load(root, "reliability")
    if doc is None:
        return _missing("reliability")
    out = doc["result"]
    parts = [provenance(doc), "Fuzzers, adapter faults and kill cycles:", "",
             md_table(("target", "cases", "survived", "escaped", "lost", "tried"),
                      [(r["name"], r["cases"], r["survived"], r["escaped"], r["lost"],
                        r["tried"]) for r in out["rows"]]), "",
             "World-facing surfaces:", "",
             md_table(("surface", "cases", "answered", "escaped", "lost", "hangs",
                       "tracebacks", "RSS growth (MB)", "tried"),
                      [(r["name"], r["cases"], r["answered"], r["escaped"], r["lost"],
                        r["hangs"], r["tracebacks"], f"{r['rss_growth_mb']:.0f}", r["tried"])
                       for r in out["surfaces"]]), ""]
    floods = out.get("floods", {})
    if "hook_latency" in floods:
        h = floods["hook_latency"]
        parts.append(f"Hook flood: p99 clean {h['clean_p99_us']:.2f} us, hostile "
                     f"{h['hostile_p99_us']:.2f} us (ratio {h['ratio']:.2f}, target <= 2); an "
                     f"unsampled {h['long_hit_tokens']}-token hit {h['long_hit_p99_us']:.2f} us.")
    if "labels" in floods:
        lab = floods["labels"]
        parts.append(f"Label flood: {lab['batches']} batches with a new medium/group -> "
                     f"{lab['series']} series.")
    if "http" in floods:
        web = floods["http"]
        parts.append(f"HTTP flood: {web['scrapes_ok']}/{web['scrapers']} concurrent scrapes "
                     f"answered (worst {web['worst_scrape_s']:.2f} s) while {web['idle']} idle "
                     f"connections were held ({web['idle_closed']} closed by the timeout).")
    failed = [name for name, good in out["checks"].items() if not good]
    parts += ["", f"Checks: {len(out['checks'])}, "
              + ("all hold." if not failed else "failed: " + "; ".join(failed))]
    return "\n".join(parts)


def demo_output(root: Path) -> str:
    """``make demo``'s summary as a recorded run printed it."""
    doc = load(root, "demo")
    if doc is None:
        return _missing("demo")
    return "\n".join([provenance(doc), "```text", f"$ {doc['command']}",
                      str(doc["result"]).rstrip(), "```"])
