"""Every generated output of the site, in one list (what ``--check`` compares)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from kvtestbed.docs import alert_pages, bench_tables, cli_help, code_tables, config_tables
from kvtestbed.docs.regions import Output


def outputs(root: Path) -> list[Output]:
    pages = [
        Output("docs/reference/signals.md", code_tables.signals_page),
        Output("docs/reference/faults.md", code_tables.faults_page),
        Output("docs/reference/config.md", config_tables.config_page),
        Output("docs/reference/cli.md", cli_help.cli_page),
        Output("docs/adapters/capabilities.md", code_tables.capabilities_table,
               region="capabilities"),
        Output("docs/getting-started.md", partial(bench_tables.demo_output, root),
               region="demo-output"),
        Output("docs/concepts/tolerances.md", code_tables.tolerance_table, region="tolerances"),
        Output("docs/guides/vllm.md", code_tables.vllm_layouts, region="vllm-layouts"),
        Output("docs/concepts/allocator.md", code_tables.thresholds_table, region="thresholds"),
        Output("docs/operations/dashboards-and-alerts.md",
               partial(alert_pages.alerts_table, root), region="alerts"),
        Output("docs/bench/detection.md", partial(bench_tables.detection, root),
               region="detection"),
        Output("docs/bench/detection.md", partial(bench_tables.detection, root, "detection-hybrid"),
               region="detection-hybrid"),
        Output("docs/bench/perf.md", partial(bench_tables.perf, root), region="perf"),
        Output("docs/bench/perf.md", partial(bench_tables.perf_vllm, root),
               region="perf-vllm"),
        Output("docs/bench/perf.md", partial(bench_tables.perf_sglang, root),
               region="perf-sglang"),
        Output("docs/bench/reliability.md", partial(bench_tables.reliability, root),
               region="reliability"),
    ]
    pages += [Output(f"{alert_pages.RUNBOOK_COPIES}/{name}.md",
                     partial(alert_pages.runbook_copy, root, name), header=False)
              for name in alert_pages.runbook_names(root)]
    return pages


def orphans(root: Path) -> list[str]:
    """Runbook copies whose runbook is gone (an alert removed): stale, removed on write."""
    keep = set(alert_pages.runbook_names(root))
    folder = root / alert_pages.RUNBOOK_COPIES
    return [f"{alert_pages.RUNBOOK_COPIES}/{p.name}" for p in sorted(folder.glob("*.md"))
            if p.stem not in keep] if folder.is_dir() else []
