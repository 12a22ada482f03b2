"""The sidecar process of ``dispatch = "process"``: the real Monitor, fed by an engine's
front (:mod:`sidecar.adapters.remote.front`) over the probe pipe.

* :class:`RemoteAdapter` is the Monitor's view of the engine from here: captures come with
  the sampled hits (``reread = False``), the allocator state and block tables from the last
  census, and the recompute from a reference this process built itself (the engine
  adapter's ``remote_reference`` capability names how: for the reference engines the same
  model config and seed, so the same weights and kernels);
* :class:`RemoteSidecar` turns the front's messages back into the Monitor's hooks (the
  same :class:`~sidecar.adapters.vllm.receiver.ProbeReceiver` and its checks as vLLM's
  probe and SGLang's tap use), and adds the front's own counts to the same signals an
  in-process Monitor would have counted them in;
* :func:`child_main` is the process: it serves ``/metrics`` when given a port and answers
  the engine's process on a control pipe (drain to a mark, summary, health, stop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sidecar import signals as S
from sidecar.adapters.remote import messages as C
from sidecar.adapters.vllm.adapter import captured_hit
from sidecar.adapters.vllm.receiver import MAX_DROP_STEP, ProbeReceiver
from sidecar.adapters.vllm.wire import Capture, WireError
from sidecar.config.settings import SidecarConfig
from sidecar.core.monitor import Monitor
from sidecar.core.protocol import (
    AdapterError,
    AllocatorState,
    BlockKV,
    BlockRef,
    BlockTableSnapshot,
    EngineInfo,
    Hit,
    Lookup,
    StoredBlock,
    TierState,
)
from sidecar.signals import DropReason, InputReject

log = logging.getLogger(__name__)

HOOKS = frozenset({"on_lookup", "on_store", "on_free", "on_allocate", "on_release",
                   "on_request_done", "on_tier", "capture", "census"})
_REASONS = frozenset(r.value for r in InputReject)
_DROPS = frozenset(r.value for r in DropReason)
_TIERS = {s.value: s for s in TierState}


class RemoteAdapter:
    """See the module docstring."""

    reread = False

    def __init__(self, info: EngineInfo, reference: Any) -> None:
        self.info = info
        self.reference = reference
        self.reference_kind = str(getattr(reference, "reference_kind", "independent"))
        self.state: AllocatorState | None = None
        self.tables: tuple[BlockTableSnapshot, ...] = ()

    def describe(self) -> EngineInfo:
        return self.info

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        raise AdapterError("the engine runs in another process: blocks are copied at match "
                           "time by its front")

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        return list(self.reference.recompute(hit, refs))

    def allocator(self) -> AllocatorState | None:
        return self.state

    def block_tables(self) -> tuple[BlockTableSnapshot, ...]:
        return self.tables


class RemoteSidecar:
    """A Monitor over :class:`RemoteAdapter`, fed by the front's pipe at ``endpoint``."""

    def __init__(self, endpoint: str, info: EngineInfo, config: SidecarConfig,
                 reference: Any, registry: Any = None, source: str | None = None) -> None:
        self.adapter = RemoteAdapter(info, reference)
        # Polled once per census, as it arrives (below), never on a schedule or a nudge:
        # a poll of a census already checked would compare the engine's hit counter as of
        # then with hits counted since (a false hit_counter_mismatch).
        self.monitor = Monitor(self.adapter, dataclasses.replace(
            config, dispatch="queued", allocator_every_s=0.0,
            allocator_check_min_interval_s=-1.0), registry, info=info)
        self.metrics = self.monitor.metrics
        self.mark = 0
        self._marked = threading.Condition()
        self._counts: dict[tuple[str, ...], int] = {}  # the front's totals, as last seen
        self.receiver = ProbeReceiver(
            endpoint, self.metrics, self._on_lookups, self._on_capture,
            groups=[g.group_id for g in info.groups],
            handlers={"block_stores": self._stores, "block_frees": self._frees,
                      "lifecycle": self._lifecycle, "requests": self._requests,
                      "tiers": self._tiers, "census": self._census, "mark": self._mark},
            sources=None if source is None else [source])

    def start(self) -> RemoteSidecar:
        self.receiver.start()
        self.monitor.start()
        return self

    def stop(self) -> None:
        self.receiver.stop()
        self.monitor.stop()

    # ------------------------------------------------------------------ messages
    def _on_lookups(self, items: list[tuple[int, int]]) -> None:
        on_lookup = self.monitor.on_lookup
        for q, h in items:
            on_lookup(Lookup(q, h))

    def _on_capture(self, cap: Capture) -> None:
        self.monitor.on_captured(*captured_hit(cap))

    @staticmethod
    def _items(msg: dict[str, Any], width: int | None = None) -> list[Any]:
        items = msg.get("items")
        if not isinstance(items, list) or (width is not None and not all(
                isinstance(i, list) and len(i) == width for i in items)):
            raise WireError(f"{msg.get('kind', 'a run')} items are not lists of {width}")
        return items

    def _stores(self, msg: dict[str, Any]) -> None:
        """Each store as the engine made it: the Monitor's own checks judge its fields."""
        on_store = self.monitor.on_store
        for g, b, gen, tokens, prefix, fields, parent, digest, seq, pdigest, path in \
                self._items(msg, 11):
            on_store(StoredBlock(g, b, gen, tokens, prefix, fields or {}, parent, digest,
                                 seq, pdigest, path))

    def _frees(self, msg: dict[str, Any]) -> None:
        on_free = self.monitor.on_free
        for g, ids in self._items(msg, 2):
            on_free(g, ids)

    def _lifecycle(self, msg: dict[str, Any]) -> None:
        m = self.monitor
        for op, g, seq, ids, gens in self._items(msg, 5):
            if op == 0:
                m.on_allocate(g, seq, ids, gens)
            elif op == 1:
                m.on_release(g, seq, ids)
            else:
                raise WireError("a lifecycle op is not 0 (allocate) or 1 (release)")

    def _requests(self, msg: dict[str, Any]) -> None:
        done = self.monitor.on_request_done
        for latency in self._items(msg):
            done(latency)

    def _tiers(self, msg: dict[str, Any]) -> None:
        on_tier = self.monitor.on_tier
        for g, b, state, seconds in self._items(msg, 4):
            on_tier(g, b, _TIERS.get(state, state), seconds)

    def _census(self, msg: dict[str, Any]) -> None:
        state, tables = C.decode_state(msg.get("state")), C.decode_tables(msg.get("tables"))
        counts = C.decode_counts(msg.get("counts"))
        if state is not None:
            self.adapter.state = state
        if tables is not None:
            self.adapter.tables = tables
        self._front_counts(counts)
        if state is not None or tables is not None:
            # every event before the census is applied (lookups are counted as they come):
            # the sidecar's count is then never ahead of the engine's counter in the census
            self.monitor.poll_allocator()

    def _front_counts(self, counts: dict[str, Any]) -> None:
        """The front's own totals (refused input, samples it dropped, its hook errors,
        events lost before the pipe) into the signals an in-process Monitor counts them in."""
        for (hook, reason), n in counts["rejected"].items():
            if hook in HOOKS and reason in _REASONS:
                self._grow(("rejected", hook, reason), n, S.HOOK_INPUT_REJECTED,
                           hook=hook, reason=reason)
        for reason, n in counts["dropped"].items():
            if reason in _DROPS:
                self._grow(("dropped", reason), n, S.SAMPLES_DROPPED, reason=reason)
        for hook, n in counts["hook_errors"].items():
            if hook in HOOKS:
                self._grow(("hook_errors", hook), n, S.HOOK_ERRORS, hook=hook)
        for what, n in counts["outbox_full"].items():
            if what == "capture":
                self._grow(("full", what), n, S.SAMPLES_DROPPED,
                           reason=DropReason.QUEUE_FULL.value)
            elif what in ("lookups", "events"):
                self._grow(("full", what), n, S.PROBE_LOST, what=(
                    S.ProbeLoss.LOOKUPS if what == "lookups" else S.ProbeLoss.MESSAGES).value)

    def _grow(self, key: tuple[str, ...], total: int, signal: S.Signal, **labels: str) -> None:
        """Count what a front total grew by since its last census (at most
        :data:`MAX_DROP_STEP` a census: a claim, never trusted past that)."""
        before = self._counts.get(key, 0)
        if total > before:
            self.metrics.inc(signal, min(total - before, MAX_DROP_STEP), **labels)
        self._counts[key] = total

    def _mark(self, msg: dict[str, Any]) -> None:
        n = msg.get("n")
        if type(n) is not int:
            raise WireError("a mark is not an int")
        if "counts" in msg:
            self._front_counts(C.decode_counts(msg["counts"]))
        with self._marked:
            self.mark = max(self.mark, n)
            self._marked.notify_all()

    def wait_mark(self, n: int, timeout_s: float) -> bool:
        """Wait until the front's mark ``n`` arrived: every event sent before it is here."""
        with self._marked:
            return self._marked.wait_for(lambda: self.mark >= n, timeout_s)

    def drain(self, mark: int, timeout_s: float) -> bool:
        """Every event before ``mark`` applied and every sample before it verified."""
        ok = self.wait_mark(mark, timeout_s)
        self.monitor.journal.drain()
        return self.monitor.drain(timeout_s) and ok


def child_main(endpoint: str, info: EngineInfo, config: SidecarConfig,
               reference_factory: Callable[[], Any], conn: Any,
               http: dict[str, Any] | None = None, log_level: int = logging.WARNING,
               source: str | None = None) -> None:
    """The sidecar process (spawned by :class:`sidecar.adapters.remote.process.SidecarProcess`).
    Answers ``(command, *args)`` on ``conn`` until ``stop`` or until the engine's process
    is gone; the first message it sends is ``("ready", url)`` or ``("failed", why)``."""
    logging.basicConfig(level=log_level, format="kv-sidecar[%(process)d] %(levelname)s "
                                                "%(name)s: %(message)s")
    parent = os.getppid()
    server = None
    sidecar: RemoteSidecar | None = None
    import torch

    # One intra-op thread: the recompute must not take every core from the engine beside
    # it (an in-process Monitor shares the engine's setting; a spawned process has its own).
    torch.set_num_threads(1)
    try:
        sidecar = RemoteSidecar(endpoint, info, config, reference_factory(),
                                source=source).start()
        if http is not None:
            from sidecar.core.health import monitor_health
            from sidecar.export.server import SidecarServer

            m = sidecar.monitor
            server = SidecarServer(m.metrics.registry, m.summary, port=http.get("port", 0),
                                   token=http.get("token"), health=lambda: monitor_health(
                                       m, {"front_pipe": lambda: sidecar.receiver.alive})
                                   ).start()
    except Exception as exc:  # e.g. the /metrics port is taken: nothing left behind
        log.exception("kv-sidecar process failed to start")
        if sidecar is not None:
            with contextlib.suppress(Exception):
                sidecar.stop()
        _unlink(endpoint)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", server.url if server is not None else None))
    assert sidecar is not None
    try:
        _serve(sidecar, conn, parent)
    finally:
        if server is not None:
            server.stop()
        sidecar.stop()
        _unlink(endpoint)


def _unlink(endpoint: str) -> None:
    """Remove an ipc endpoint's socket file (one was left in /tmp per run)."""
    if endpoint.startswith("ipc://"):
        with contextlib.suppress(OSError):
            os.unlink(endpoint.removeprefix("ipc://"))


def _serve(sidecar: RemoteSidecar, conn: Any, parent: int) -> None:
    m = sidecar.monitor
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:  # the engine's process is gone: so is our job
                return
            continue
        try:
            cmd, *args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "drain":
                reply: Any = sidecar.drain(int(args[0]), float(args[1]))
            elif cmd == "summary":
                reply = m.summary()
            elif cmd == "cpu":  # this process's CPU seconds (bench perf's figure)
                reply = time.process_time()
            elif cmd == "health":
                reply = m.health()
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", reply))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
