"""Building blocks shared by kv-sidecar's dashboards: variables, selectors, panels, layout.

Every metric name comes from :mod:`sidecar.signals` (never a string literal here), every
panel is built through :func:`timeseries`, :func:`stat` or :func:`table`, which require a
unit, and every range in a rate is ``$__rate_interval`` (``$__range`` for whole-range
totals), so a panel cannot silently drift from the exporter or lie about its unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from grafanalib.core import (
    GridPos,
    Panel,
    RowPanel,
    Stat,
    Table,
    Target,
    Template,
    Templating,
    TimeSeries,
)

from sidecar import signals as S
from sidecar.signals import Signal

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
RANGE = "$__range"

# Dashboard variables, outermost first; each one narrows the next one's values.
VARIABLES: tuple[str, ...] = ("job", "instance", *S.BASE_LABELS)
SELECTOR = ", ".join(f'{v}=~"${v}"' for v in VARIABLES)


def sel(sig: Signal, suffix: str = "", extra: str = "") -> str:
    """``name{job=~"$job", ...}`` for a signal (``suffix``: ``_bucket``, ``_count``)."""
    matchers = f"{SELECTOR}, {extra}" if extra else SELECTOR
    return f"{sig.name}{suffix}{{{matchers}}}"


def rate(sig: Signal, by: str = "", suffix: str = "", window: str = RATE) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({sel(sig, suffix)}[{window}]))"


def ratio(num: Signal, den: Signal, by: str = "") -> str:
    """A ratio of sums (never an average of per-series ratios)."""
    return f"{rate(num, by)}\n/\n{rate(den, by)}"


def quantile(q: float, sig: Signal, by: str = "") -> str:
    keep = f"{by}, le" if by else "le"
    return f"histogram_quantile({q:g}, {rate(sig, keep, suffix='_bucket')})"


def templating() -> Templating:
    """Data source, then job, instance, engine and model, each multi-valued with All."""
    items = [Template(name="datasource", label="Data source", query="prometheus",
                      type="datasource", default="default")]
    for i, var in enumerate(VARIABLES):
        upstream = ", ".join(f'{v}=~"${v}"' for v in VARIABLES[:i])
        query = f"label_values({S.BUILD_INFO.name}{{{upstream}}}, {var})"
        items.append(Template(name=var, label=var, query=query, dataSource=DATASOURCE,
                              includeAll=True, multi=True, default="$__all",
                              allValue=".+", refresh=2))
    return Templating(list=items)


def targets(exprs: Sequence[tuple[str, str]], instant: bool = False) -> list[Target]:
    return [Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i),
                   datasource=DATASOURCE, instant=instant,
                   format="table" if instant else "time_series")
            for i, (expr, legend) in enumerate(exprs)]


def steps(base: str, *levels: tuple[float, str]) -> list[dict[str, object]]:
    """Grafana threshold steps: ``base`` colour, then ``(value, colour)`` from there up."""
    out: list[dict[str, object]] = [{"color": base, "value": None}]
    out += [{"color": colour, "value": value} for value, colour in levels]
    return out


def timeseries(title: str, description: str, unit: str, exprs: Sequence[tuple[str, str]],
               thresholds: list[dict[str, object]] | None = None) -> TimeSeries:
    return TimeSeries(
        title=title, description=description, unit=unit, dataSource=DATASOURCE,
        targets=targets(exprs), legendDisplayMode="table", legendPlacement="bottom",
        legendCalcs=["lastNotNull", "max"], tooltipMode="multi",
        thresholds=thresholds or steps("green"),
        thresholdsStyleMode="dashed" if thresholds else "off")


def stat(title: str, description: str, unit: str, exprs: Sequence[tuple[str, str]],
         thresholds: list[dict[str, object]], decimals: int | None = None) -> Stat:
    """One value per ``(expr, legend)``, side by side, coloured by ``thresholds``."""
    return Stat(title=title, description=description, format=unit, dataSource=DATASOURCE,
                targets=targets(exprs), thresholds=thresholds, textMode="value_and_name",
                reduceCalc="lastNotNull", colorMode="background", graphMode="area",
                decimals=decimals, noValue="no data")


def table(title: str, description: str, exprs: Sequence[tuple[str, str, str]]) -> Table:
    """An instant-query table, one column per ``(expr, column name, unit)``, merged on
    their shared labels."""
    overrides = [
        {"matcher": {"id": "byName", "options": f"Value #{chr(ord('A') + i)}"},
         "properties": [{"id": "displayName", "value": name}, {"id": "unit", "value": unit}]}
        for i, (_, name, unit) in enumerate(exprs)]
    return Table(title=title, description=description, unit=exprs[0][2],
                 dataSource=DATASOURCE,
                 targets=targets([(e, name) for e, name, _ in exprs], instant=True),
                 transformations=[{"id": "merge", "options": {}}], overrides=overrides)


def layout(rows: Iterable[tuple[str, Sequence[tuple[Panel, int, int]]]]) -> list[Panel]:
    """Place ``(title, [(panel, width, height), ...])`` rows on Grafana's 24-column grid,
    wrapping a row's panels onto new lines when they overflow."""
    out: list[Panel] = []
    y = 0
    for title, panels in rows:
        out.append(RowPanel(title=title, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        x = 0
        line_height = 0
        for panel, w, h in panels:
            if x + w > 24:
                x, y, line_height = 0, y + line_height, 0
            panel.gridPos = GridPos(h=h, w=w, x=x, y=y)
            x += w
            line_height = max(line_height, h)
        y += line_height
        out.extend(p for p, _, _ in panels)
    return out
