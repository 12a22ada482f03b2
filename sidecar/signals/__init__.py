"""The single source of truth for kv-sidecar's signal names, labels, kinds and thresholds.

Everything that names a signal imports it from here: the exporter (:mod:`sidecar.export.metrics`),
the dashboards (``dashboards/*.dashboard.py``), the alert-rule generator (``alerts/``), the
docs site's signals page (``python -m kvtestbed.docs``, ``kv-sidecar signals --markdown``) and
the tests. Renaming a metric is a one-line change where it is defined.

Where each set is defined:

* :mod:`sidecar.core.signal_types`: what a signal is (:class:`Signal`, its kinds, buckets);
* :mod:`.core`: the engine-agnostic signals every sidecar exports; :mod:`.kinds`: their
  label values, the alerting thresholds and alert names;
* each adapter's own set beside it: :mod:`sidecar.adapters.vllm.signals`,
  :mod:`sidecar.adapters.sglang.signals`, :mod:`sidecar.canary.signals`,
  :mod:`sidecar.protect.signals` (the guard), :mod:`sidecar.export.signals` (OTLP push
  health); LMCache's in :mod:`.lmcache` (its package
  imports its Monitor when imported, which imports this one).

:data:`ALL_SIGNALS` is assembled once, below. An adapter's set is exported only where the
adapter runs: the one registration path is ``Metrics.register(ADAPTER_SIGNALS[name])`` (or
the set's own name) when the adapter attaches; the core's are registered by every Metrics.
"""

from __future__ import annotations

from sidecar.adapters.sglang.signals import *  # noqa: F403
from sidecar.adapters.vllm.signals import *  # noqa: F403
from sidecar.canary.signals import *  # noqa: F403
from sidecar.core.signal_types import *  # noqa: F403
from sidecar.export.signals import *  # noqa: F403
from sidecar.protect.signals import *  # noqa: F403
from sidecar.signals.core import *  # noqa: F403
from sidecar.signals.kinds import *  # noqa: F403
from sidecar.signals.lmcache import *  # noqa: F403

# In the order the docs' signals page, the dashboards and /metrics list them (unchanged since the
# sets lived in one module).
ALL_SIGNALS: tuple[Signal, ...] = (  # noqa: F405
    *BASE_SIGNALS, *VLLM_SIGNALS, *TOLERANCE_SIGNALS, *CANARY_SIGNALS,  # noqa: F405
    *LMCACHE_SIGNALS, HOOK_INPUT_REJECTED, *SCRUB_ACTION_SIGNALS, *HYBRID_SIGNALS,  # noqa: F405
    *GUARD_SIGNALS, PREFIX_CACHE_RESETS, *SGLANG_SIGNALS, *OUTLOOK_SIGNALS,  # noqa: F405
    *CAPABILITY_SIGNALS, *OTLP_SIGNALS,  # noqa: F405
)

# Signals an adapter owns and registers itself (``Metrics.register``) where it runs: a
# sidecar beside the reference engine exports none of vLLM's, the canary's or LMCache's.
ADAPTER_SIGNALS: dict[str, tuple[Signal, ...]] = {  # noqa: F405
    "vllm": VLLM_SIGNALS, "canary": CANARY_SIGNALS, "lmcache": LMCACHE_SIGNALS,  # noqa: F405
    "guard": (*GUARD_SIGNALS, PREFIX_CACHE_RESETS),  # noqa: F405
    "sglang": SGLANG_SIGNALS, "otlp": OTLP_SIGNALS,  # noqa: F405
}


def core_signals() -> tuple[Signal, ...]:  # noqa: F405
    """Every engine-agnostic signal: what any sidecar exports."""
    owned = {s.name for group in ADAPTER_SIGNALS.values() for s in group}
    return tuple(s for s in ALL_SIGNALS if s.name not in owned)


def by_name(name: str) -> Signal:  # noqa: F405
    """Look a signal up by its exposition name; a clear error for an unknown one."""
    for s in ALL_SIGNALS:
        if s.name == name:
            return s
    raise KeyError(f"unknown signal {name!r}; known: {', '.join(s.name for s in ALL_SIGNALS)}")


def markdown_table() -> str:
    """The signals as a Markdown table (``kv-sidecar signals --markdown``)."""
    rows = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    for s in ALL_SIGNALS:
        labels = ", ".join(BASE_LABELS + s.labels)  # noqa: F405
        rows.append(f"| `{s.name}` | {s.type.value} | {labels} | {s.help} |")
    return "\n".join(rows)
