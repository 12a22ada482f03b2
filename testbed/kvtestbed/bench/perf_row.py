"""One row of ``kv-sidecar bench perf``'s table, and the table, apart from
:mod:`kvtestbed.bench.perf` so the benchmarks that add rows (:mod:`kvtestbed.bench.perf_guard`,
:mod:`kvtestbed.bench.perf_vllm`) need not import the runner."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    """One line of the table. ``met`` is None where the issue sets no target; ``ratio`` None
    where it has no meaning (a figure that is 0 in the baseline: shown as "-", JSON null)."""

    figure: str
    sidecar: float
    baseline: float
    unit: str
    ratio: float | None
    target: str
    met: bool | None
    spread: str = ""


def format_table(rows: list[Row]) -> str:
    out = ["| figure | sidecar | baseline | ratio | target | met | spread |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        out.append(f"| {r.figure} | {r.sidecar:.4g} {r.unit} | {r.baseline:.4g} {r.unit} | "
                   f"{'-' if r.ratio is None else f'{r.ratio:.3g}'} | {r.target} | {met} | "
                   f"{r.spread} |")
    return "\n".join(out)
