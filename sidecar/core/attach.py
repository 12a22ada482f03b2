"""Resolve an adapter's (and a sampler's) optional capabilities once, when a Monitor attaches.

Every capability is declared in :mod:`sidecar.core.capabilities`; this is the only place
that looks at an adapter or sampler to see which it offers. :func:`resolve` runs the
conformance check (:mod:`sidecar.core.conformance`) on each: a capability with a wrong
signature or value is *refused* (logged once, with a message naming it, and left out: the
Monitor runs without it instead of failing later in a verifier thread), a misspelt one is
reported. The Monitor, verifier, scrubber, poller and quarantine read the
:class:`Capabilities` it returns, never the adapter's attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sidecar import signals as S
from sidecar.core.capabilities import (
    REFERENCE_KINDS,
    AllocatorIntrospection,
    Evictor,
    ScrubSource,
    declared,
)
from sidecar.core.conformance import check_capabilities, protocol_members
from sidecar.core.protocol import Adapter, BlockKV, BlockRef, Hit

log = logging.getLogger(__name__)

DEFAULT_REFERENCE_KIND = "independent"


def _independent() -> str:
    return DEFAULT_REFERENCE_KIND


@dataclass(frozen=True)
class Capabilities:
    """The optional capabilities in force for one attached adapter and sampler (``None``:
    not offered, or refused), and what the conformance check found (capability -> problems;
    ``refused``: the offered ones left out because of them)."""

    capture: Callable[[Hit, Sequence[BlockRef]], Sequence[BlockKV]] | None = None
    reread: bool = True
    reference_kind: Callable[[], str] = _independent
    busy: Callable[[], bool] | None = None
    introspection: AllocatorIntrospection | None = None
    scrub_source: ScrubSource | None = None
    evictor: Evictor | None = None
    remote_reference: Callable[[], Callable[[], object]] | None = None
    observe_store: Callable[..., Any] | None = None
    observe_free: Callable[..., Any] | None = None
    observe_release: Callable[..., Any] | None = None
    problems: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    refused: frozenset[str] = frozenset()
    adapter: object = None  # the adapter these were resolved for

    @property
    def in_use(self) -> frozenset[str]:
        """Names of the capabilities in force."""
        values = {"capture": self.capture, "busy": self.busy,
                  "block_tables": self.introspection, "scrub_hit": self.scrub_source,
                  "evict": self.evictor, "remote_reference": self.remote_reference,
                  "observe_store": self.observe_store,
                  "observe_free": self.observe_free, "observe_release": self.observe_release}
        names = {n for n, v in values.items() if v is not None}
        if not self.reread:
            names.add("reread")
        if self.reference_kind is not _independent:
            names.add("reference_kind")
        return frozenset(names)


def _reference_kind(adapter: Any) -> Callable[[], str]:
    """Read per verification (an adapter may swap its reference at run time); a value
    outside :data:`REFERENCE_KINDS` counts as the default (it is a bounded label)."""
    def kind() -> str:
        try:
            value = adapter.reference_kind
        except Exception:
            return DEFAULT_REFERENCE_KIND
        return value if value in REFERENCE_KINDS else DEFAULT_REFERENCE_KIND
    return kind


def resolve(adapter: Adapter, sampler: Any = None, *, quiet: bool = False) -> Capabilities:
    """Check and resolve ``adapter``'s and ``sampler``'s capabilities (see the module
    docstring); problems are logged once here unless ``quiet``."""
    problems: dict[str, list[str]] = {}
    problems.update(check_capabilities(adapter, "adapter", set(protocol_members(Adapter))))
    sampler_known = {"should_sample", "choose", "feedback"}
    if sampler is not None:
        for name, found in check_capabilities(sampler, "sampler", sampler_known).items():
            problems.setdefault(name, []).extend(found)
    offered = {c.name: (adapter if c.owner == "adapter" else sampler)
               for c in (*declared("adapter"), *declared("sampler"))}
    refused = {n for n in problems
               if offered.get(n) is not None and hasattr(offered[n], n)}

    def take(name: str) -> Any:
        owner = offered[name]
        if owner is None or name in refused or not hasattr(owner, name):
            return None
        return getattr(owner, name)

    caps = Capabilities(
        capture=take("capture"),
        reread=take("reread") if take("reread") is not None else True,
        reference_kind=(_reference_kind(adapter) if take("reference_kind") is not None
                        else _independent),
        busy=take("busy"),
        introspection=cast(AllocatorIntrospection, adapter) if take("block_tables") else None,
        scrub_source=cast(ScrubSource, adapter) if take("scrub_hit") else None,
        evictor=cast(Evictor, adapter) if take("evict") else None,
        remote_reference=take("remote_reference"),
        observe_store=take("observe_store"), observe_free=take("observe_free"),
        observe_release=take("observe_release"),
        problems={n: tuple(p) for n, p in problems.items()}, refused=frozenset(refused),
        adapter=adapter)
    if not quiet:
        for name, found in sorted(problems.items()):
            action = "refused, running without it" if name in refused else "reported"
            log.warning("kv-sidecar capability %s of %s %s: %s", name,
                        type(offered.get(name) or adapter).__name__, action, "; ".join(found))
    return caps


def export(caps: Capabilities, metrics: Any) -> None:
    """Publish what attach found: ``capability_problems{capability}`` (0 for a clean one)
    and ``capability_in_use{capability}`` (1 in force, 0 not offered or refused)."""
    in_use = caps.in_use
    for cap in (*declared("adapter"), *declared("sampler")):
        metrics.gauge(S.CAPABILITY_PROBLEMS, capability=cap.name).set(
            len(caps.problems.get(cap.name, ())))
        metrics.gauge(S.CAPABILITY_IN_USE, capability=cap.name).set(
            1 if cap.name in in_use else 0)
