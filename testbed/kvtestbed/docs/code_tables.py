"""Reference pages read from the code's own tables: signals, faults and capabilities."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable

from sidecar import signals
from sidecar.core import capabilities


def md_table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    """A Markdown table; ``|`` inside a cell is escaped so a help text cannot split a row."""
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(c).replace("|", "\\|").replace("\n", " ") for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


_FIELD = re.compile(r"^\s{4}(\w+)\s*:\s*[^=]+?(?:=.*?)?(?:#\s*(.*))?$")


def field_comments(cls: type) -> dict[str, str]:
    """Each dataclass field's comment: the ``#`` lines right above it and its own (a
    comment block above a run of fields is the first one's: the others say theirs inline)."""
    lines = inspect.getsource(cls).splitlines()
    notes: dict[str, str] = {}
    above: list[str] = []
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        match = _FIELD.match(line)
        if match and not stripped.startswith(("def ", "@", '"""')):
            notes[match.group(1)] = rst_to_md(" ".join([*above, match.group(2) or ""]).strip())
            above = []  # a comment block documents the field right under it
        else:
            above = []
    return notes


def _owner(name: str) -> str:
    for adapter, group in signals.ADAPTER_SIGNALS.items():
        if any(s.name == name for s in group):
            return adapter
    return "every sidecar"


def signals_page() -> str:
    """Every signal of :data:`sidecar.signals.ALL_SIGNALS`, with who exports it."""
    rows = [(f"`{s.name}`", s.type.value, ", ".join(signals.BASE_LABELS + s.labels),
             _owner(s.name), s.help) for s in signals.ALL_SIGNALS]
    return "\n".join([
        "# Signals", "",
        "Every series kv-sidecar exports, from `sidecar/signals/` (the one source of truth the "
        "exporter, the dashboards and the alert rules read; `kv-sidecar signals` prints the "
        "same list). Every series carries `engine` and `model`; no label ever holds a request "
        "id, block id, token or prompt text. *Exported by* says where a set is registered: "
        "an adapter's own signals only where that adapter runs.", "",
        f"{len(rows)} signals.", "",
        md_table(("name", "type", "labels", "exported by", "meaning"), rows), "",
        "The content-anomaly rate is `sum(rate(kvsidecar_anomalies_total[5m])) / "
        "sum(rate(kvsidecar_verified_total[5m]))`; P99 latency is "
        "`histogram_quantile(0.99, sum by (le) "
        "(rate(kvsidecar_request_latency_seconds_bucket[5m])))`.", ""])


def faults_page() -> str:
    """The testbed's fault catalogue (``kv-sidecar faults``), with what each one needs."""
    from kvtestbed.engines.faults import FAULTS

    rows = []
    for name, cls in FAULTS.items():
        groups = ", ".join(sorted(str(g) for g in getattr(cls, "needs_groups", ()))) or "-"
        needs = ", ".join(f"{k}={v}" for k, v in sorted(cls.engine_needs.items())) or "-"
        rows.append((f"`{name}`", cls.description, groups, needs))
    return "\n".join([
        "# Faults", "",
        "What the reference engines can inject (`kv-sidecar faults`, "
        "`testbed/kvtestbed/engines/faults.py`). *Cache groups* names the groups a fault acts "
        "on (it runs on the models that have them: `--model hybrid` or `recurrent`); *engine "
        "settings* the engine configuration it cannot act without (the demo and the detection "
        "bench apply it).", "",
        md_table(("fault", "what goes wrong", "cache groups", "engine settings"), rows), ""])


def _signature(cap: capabilities.Capability) -> str:
    member = getattr(cap.protocol, cap.name, None)
    if cap.values is not None:
        return f"`{cap.name}` = one of " + ", ".join(f"`{v!r}`" for v in cap.values)
    if callable(member):
        sig = str(inspect.signature(member)).replace("self, ", "").replace("(self)", "()")
        sig = sig.replace("'", "")
        return f"`{cap.name}{sig}`"
    return f"`{cap.name}`"


def rst_to_md(text: str) -> str:
    """Docstring markup as Markdown: ``x`` and :role:`~a.b.X` become `x` and `X`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def _first_paragraph(doc: str | None) -> str:
    text = inspect.cleandoc(doc or "")
    return rst_to_md(" ".join(text.split("\n\n", 1)[0].split()))


def capabilities_table() -> str:
    """Every optional capability of :data:`sidecar.core.capabilities.CAPABILITIES`."""
    rows = [(_signature(c), c.owner, f"`{c.protocol.__name__}`",
             _first_paragraph(c.protocol.__doc__)) for c in capabilities.CAPABILITIES]
    return md_table(("member", "offered by", "protocol", "what it is for"), rows)


def capabilities_page() -> str:
    return "\n".join([
        "# Capabilities", "",
        "Every optional capability beyond the four required adapter methods, from "
        "`sidecar/core/capabilities.py`. The Monitor resolves them once, when it attaches "
        "(`sidecar/core/attach.py`): a capability with a wrong signature or value is refused "
        "and named in `kvsidecar_capability_problems{capability}`; "
        "`kvsidecar_capability_in_use{capability}` says what is in force.", "",
        capabilities_table(), ""])


def tolerance_table() -> str:
    """The recompute tolerances in force, per dtype, from :mod:`sidecar.checks.tolerance`."""
    from sidecar.checks import tolerance as tol
    from sidecar.config.settings import SidecarConfig

    rows = [(f"`{dtype}`", f"{hard:g}", f"{tol.EPSILON[dtype]:.3g}",
             f"{tol.min_tolerance(dtype):.3g}"
             + (" (measured)" if dtype in tol.MEASURED_MINIMUMS else
                f" ({tol.MIN_ULPS:g} epsilons)"))
            for dtype, hard in tol.TOLERANCES.items()]
    storage = ", ".join(f"`{k}` {v:g}" for k, v in tol.STORAGE_TOLERANCES.items())
    cfg = SidecarConfig()
    return "\n".join([
        md_table(("dtype", "hard tolerance (ceiling)", "epsilon", "calibrated minimum (floor)"),
                 rows), "",
        f"Lossy KV storage widens the hard tolerance to at least: {storage}. An override may "
        f"not exceed {tol.MAX_OVERRIDE:g}. Calibration defaults: "
        f"`calibration_samples = {cfg.calibration_samples}` clean blocks, "
        f"`calibration_multiple = {cfg.calibration_multiple:g}`."])


def thresholds_table() -> str:
    """The alerting thresholds (:data:`sidecar.signals.THRESHOLDS`), with their comments."""
    import dataclasses

    notes = field_comments(type(signals.THRESHOLDS))
    rows = [(f"`{f.name}`", f"{getattr(signals.THRESHOLDS, f.name):g}", notes.get(f.name, ""))
            for f in dataclasses.fields(signals.THRESHOLDS)]
    return md_table(("threshold", "value", "note"), rows)


def vllm_layouts() -> str:
    """What the vLLM probe decodes, from :mod:`sidecar.adapters.vllm.layout` and its version pin."""
    from sidecar.adapters.vllm import layout
    from sidecar.adapters.vllm.version import SUPPORTED_VLLM

    def names(items: Iterable[object]) -> str:
        return ", ".join(f"`{i}`" for i in items)

    return "\n".join([
        f"* vLLM versions: {names(SUPPORTED_VLLM)} (any other: the probe refuses to start).",
        f"* GPU attention backends: {names(layout.GPU_BACKENDS)}, in the `KVCacheLayout` "
        f"physical orders {names(layout.STRIDE_LAYOUTS)}; tensor-parallel ranks' heads merged.",
        f"* CPU attention backend `{layout.CPU_BACKEND}`, kernel orders "
        f"{names(layout.SUPPORTED_ISAS)}."])
