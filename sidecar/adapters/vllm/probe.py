"""The in-engine probe: a vLLM KV connector that samples prefix hits and ships their KV.

Why a KV connector (``KVTransferConfig(kv_connector_module_path=...)``) rather than a worker
extension or a general plugin: it is the one supported extension point that sees *both*
sides of a hit. Its scheduler half is told, for every new request, how many prompt tokens
the local prefix cache matched and which block ids the request got (``build_connector_meta``
receives ``NewRequestData.num_computed_tokens`` and ``block_ids``); its worker half is handed
the KV-cache tensors (``register_kv_caches``) and runs after every forward
(``wait_for_save``). A worker extension sees only tensors and would need the hits from
elsewhere; a general plugin would have to patch vLLM internals. The connector is loaded by
module path, needs no install step beyond the sidecar package, and never changes what the
engine computes: it reports 0 external tokens and never delays a free.

What it does, all best-effort (an error is logged and counted, never raised into vLLM):

* scheduler half: for each newly scheduled request, a ``lookups`` entry (prompt tokens,
  tokens hit; sent in batches, :mod:`.lookup_batch`); 1 hit in ``sample_every`` (the
  sidecar's seeded :class:`UniformSampler`) is sampled and its blocks chosen (last full
  block + earlier ones in rotation, as the Monitor does). A request whose ``cache_salt`` is
  a sidecar reference salt is the sidecar's own engine-side recompute: not a lookup, its
  named blocks are captured once its prefill has run;
* worker half: after the step's forward, copies the chosen blocks into preallocated slots
  on their device, decoding the layout to (layers, kv_heads, block_size, head_dim) in that
  copy; host copy, packing and send run on the probe's own thread (:mod:`.shipper`);
* both halves: write-time fingerprints (:mod:`.block_writes`): the full blocks each forward
  completes (1 in ``fingerprint_every``, default every one) are digested after it, and a
  capture carries each captured block's digest and write path (prefill or decode), for the
  sidecar to compare with the bytes the hit was served.

Hybrid models (Gemma2: sliding window + full; LFM2: conv state + full) have one KV-cache
group per layer kind, each with its own block table. The probe chooses blocks group by
group (:func:`sidecar.core.sampling.choose_blocks`: only blocks the group must hold for the hit,
never an out-of-window or pre-boundary null block) and reads a recurrent group's blocks as
states (:mod:`.state_layout`).

vLLM's connector API is marked experimental and the KV layout is backend-specific, so the
probe runs only on the vLLM versions CI covers (:data:`sidecar.adapters.vllm.version.
SUPPORTED_VLLM`, a closed range, each end tested) and refuses to start on any other.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from sidecar.adapters.peer_settings import check_settings
from sidecar.adapters.vllm.block_writes import (
    DEFAULT_CAPACITY,
    BlockFill,
    WriteTable,
    WriteTracker,
    raw_digest,
)
from sidecar.adapters.vllm.engine_config import PROBE_KEYS
from sidecar.adapters.vllm.groups import group_layer_names, groups_from_specs, layer_index
from sidecar.adapters.vllm.layout import block_views, reported_layout, validate_layout
from sidecar.adapters.vllm.lookup_batch import LookupBatch
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.shipper import CaptureOrder, Shipper, Staged, default_slots
from sidecar.adapters.vllm.state_layout import (
    StateSpec,
    decode_state_block,
    state_spec,
    validate_state_layout,
)
from sidecar.adapters.vllm.version import check_vllm_version
from sidecar.adapters.vllm.wire import capture_fields, parse_reference_salt
from sidecar.core.burst import Burst
from sidecar.core.protocol import GroupKind, Hit
from sidecar.core.sampling import UniformSampler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_MAX_TRACKED = 10_000  # requests looked up but not yet scheduled/finished (bounded memory)
_COUNTS_EVERY_S = 1.0  # fingerprint counts go out at least this often (and with captures)


@dataclass
class ProbeMetadata(KVConnectorMetadata):
    captures: list[CaptureOrder] = field(default_factory=list)
    fills: list[BlockFill] = field(default_factory=list)  # full blocks this step completes


@dataclass
class _Seen:
    prompt: list[int]
    hit_tokens: int
    salt: str | None


class KVSidecarProbe(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. Configure through ``kv_connector_extra_config``:
    ``endpoint`` (required: the sidecar's PULL socket, on this host), ``sample_every`` (100),
    ``blocks_per_sample`` (2), ``seed`` (0), ``pipe_hwm`` (64 messages),
    ``fingerprint_every`` (1: every full block fingerprinted at write; 0: none),
    ``fingerprint_capacity`` (blocks remembered, oldest first out), ``capture_slots``
    (device slots per cache group; default :func:`.shipper.default_slots`), ``burst_hits``
    and ``burst_every``; checked whole at start (``engine_config.PROBE_KEYS``: an unknown key
    or a bad value stops vLLM with one line naming it)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(vllm_config, role, kv_cache_config)
        extra = check_settings(dict(self._kv_transfer_config.kv_connector_extra_config or {}),
                               PROBE_KEYS, "kv-sidecar probe: kv_connector_extra_config")
        self._block_size = int(vllm_config.cache_config.block_size)
        self._dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self._model = str(vllm_config.model_config.model)
        self._blocks_per_sample = extra["blocks_per_sample"]
        # A start burst with every probe start: an engine restart or upgrade starts a new
        # probe, so a new version, KV layout or kernel is checked at the burst's rate first.
        self._sampler = UniformSampler(extra["sample_every"], extra["seed"],
                                       burst=Burst(extra["burst_hits"], extra["burst_every"]))
        self._pipe = Pipe(extra["endpoint"], extra["pipe_hwm"])
        self._lookups = LookupBatch(self._pipe)  # the scheduler half's (another process)
        self._shipper = Shipper(self._pipe, extra["capture_slots"]
                                or default_slots(self._blocks_per_sample))
        self._group_layers = group_layer_names(kv_cache_config)
        self._groups = [g for g, _ in groups_from_specs(kv_cache_config, layer_index)]
        self._hybrid = any(g.kind is not GroupKind.FULL_ATTENTION for g in self._groups)
        self._state_specs: dict[int, StateSpec] = {
            gid: state_spec(spec.kv_cache_spec)
            for gid, spec in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or [])
            if self._groups[gid].kind is GroupKind.RECURRENT_STATE}
        # Write-time fingerprints of the attention groups (block_writes.py).
        attention = [g.group_id for g in self._groups
                     if g.kind is not GroupKind.RECURRENT_STATE] if self._groups else [0]
        self._writes = WriteTracker(
            self._block_size, extra["fingerprint_every"], attention,
            {g.group_id: frozenset(g.null_block_ids) for g in self._groups})
        self._table = WriteTable(extra["fingerprint_capacity"] or DEFAULT_CAPACITY)
        self._counts_at = time.monotonic()
        self._seen: dict[str, _Seen] = {}
        self._pending_refs: dict[str, tuple[CaptureOrder, int]] = {}  # req -> (order, need)
        self._kv: dict[str, torch.Tensor] = {}
        self._layers: dict[int, list[str]] = {}
        self._backend = "CPU_ATTN"  # the attention backend vLLM reports (register_kv_caches)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # an observer: nothing is handed off, a preempted request just restarts

    # ------------------------------------------------------------------ scheduler half
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        try:  # may be called more than once per request: keep the latest answer
            if len(self._seen) >= _MAX_TRACKED:  # oldest first; never grows without bound
                self._seen.pop(next(iter(self._seen)))
            self._seen[request.request_id] = _Seen(
                list(request.prompt_token_ids or []), int(num_computed_tokens),
                request.cache_salt)
        except Exception:
            log.exception("kv-sidecar probe: lookup bookkeeping failed (ignored)")
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ProbeMetadata()
        try:
            self._collect(scheduler_output, meta)
        except Exception:
            log.exception("kv-sidecar probe: building capture orders failed (ignored)")
        return meta

    def _collect(self, so: SchedulerOutput, meta: ProbeMetadata) -> None:
        lookups: list[list[int]] = []
        bs = self._block_size
        references: set[str] = set()
        for req in so.scheduled_new_reqs:
            seen = self._seen.pop(req.req_id, None)
            prompt = list(req.prompt_token_ids or (seen.prompt if seen else []))
            hit = int(req.num_computed_tokens)
            blocks = {g: list(ids) for g, ids in enumerate(req.block_ids)}
            wanted = parse_reference_salt(seen.salt if seen else None)
            if wanted is not None:
                references.add(req.req_id)
                order = self._reference_order(req.req_id, seen, prompt, blocks, wanted)
                need = (max(wanted) + 1) * bs
                done = hit + so.num_scheduled_tokens.get(req.req_id, 0)
                if done >= need:
                    meta.captures.append(order)
                else:  # chunked prefill: capture once the named blocks are computed
                    self._pending_refs[req.req_id] = (order, need)
                continue
            n_full = hit // bs
            h = Hit(tokens=prompt[:hit], hit_tokens=hit,
                    blocks={g: ids[:n_full] for g, ids in blocks.items()})
            if n_full > 0 and self._sampler.should_sample(h):
                # The core's chooser: the last block per group plus a rotation through the
                # earlier ones the group must hold (sidecar.core.sampling.BlockCursors).
                refs = self._sampler.choose(h, bs, self._blocks_per_sample, self._groups)
                meta.captures.append(CaptureOrder(
                    uuid.uuid4().hex[:16], "hit", seen.salt if seen else None, prompt[:hit],
                    len(prompt), hit, {g: list(ids) for g, ids in h.blocks.items()},
                    [(r.group_id, r.index, r.block_id) for r in refs]))
            else:
                lookups.append([len(prompt), hit])
        self._advance_pending_refs(so, meta)
        # The sidecar's own salted recomputes write blocks no request can hit: not tracked.
        # Best-effort on its own: a failure here never costs the step's lookups or captures.
        try:
            meta.fills = self._writes.step(so, skip=references.__contains__)
        except Exception:
            log.exception("kv-sidecar probe: tracking block writes failed (ignored)")
        self._lookups.scheduled([req.req_id for req in so.scheduled_new_reqs], lookups)

    def _reference_order(self, req_id: str, seen: _Seen | None, prompt: list[int],
                         blocks: dict[int, list[int]], wanted: list[int]) -> CaptureOrder:
        salt = seen.salt if seen else None
        order = CaptureOrder(req_id, "reference", salt, prompt, 0, len(prompt), blocks, [])
        self._name_reference_blocks(order, wanted)
        return order

    def _name_reference_blocks(self, order: CaptureOrder, wanted: list[int]) -> None:
        # Null blocks (a sliding group's out-of-window ones, a recurrent group's states before
        # the last boundary) hold nothing to compare with: not read.
        null = {g.group_id: g.null_block_ids for g in self._groups} if self._hybrid else {}
        order.refs = [(g, i, ids[i]) for g, ids in order.blocks.items() for i in wanted
                      if i < len(ids) and ids[i] not in null.get(g, ())]

    def _advance_pending_refs(self, so: SchedulerOutput, meta: ProbeMetadata) -> None:
        """A chunked reference prefill: its block tables grow with each chunk (a hybrid's
        recurrent group gets its boundary block only with the chunk that ends there), so
        the blocks to read are named once the wanted blocks are computed."""
        if not self._pending_refs:
            return
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            pending = self._pending_refs.get(req_id)
            if pending is None:
                continue
            order, need = pending
            new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
            if new_ids is not None:
                replace = req_id in cached.resumed_req_ids
                for g, ids in enumerate(new_ids):
                    order.blocks[g] = list(ids) if replace else \
                        order.blocks.get(g, []) + list(ids)
            done = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            if done >= need:
                wanted = parse_reference_salt(order.salt) or []
                self._name_reference_blocks(order, wanted)
                meta.captures.append(order)
                del self._pending_refs[req_id]

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        self._lookups.finished(req_id)
        self._seen.pop(req_id, None)
        self._writes.forget(req_id)
        self._pending_refs.pop(req_id, None)

    # ------------------------------------------------------------------ worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Raising here stops engine start-up with a clear message: better than a probe that
        # silently reads the wrong bytes.
        groups = self._group_layers or {0: list(kv_caches)}
        state_names = {n for g in self._state_specs for n in groups.get(g, [])}
        for name in state_names & set(kv_caches):
            validate_state_layout(name, kv_caches[name], self._state_specs[
                next(g for g in self._state_specs if name in groups[g])])
        attention = {n: t for n, t in kv_caches.items() if n not in state_names}
        # The decoder is the one for the backend and stride layout vLLM reports (layout.py);
        # state layers (conv/Mamba) have their own decoder (state_layout.py).
        self._backend, layout = reported_layout(self._vllm_config, list(attention))
        validate_layout(attention, self._block_size, self._backend, layout)
        self._kv = dict(kv_caches)
        self._layers = {g: sorted((n for n in names if n in kv_caches), key=layer_index)
                        for g, names in groups.items()}
        first = next(iter(attention.values()))
        self._shipper.post(
            "hello", vllm=vllm.__version__, model=self._model,
            dtype=str(first.dtype).removeprefix("torch."), block_size=self._block_size,
            kv_heads=int(first.shape[1]), head_dim=int(first.shape[3]) // 2,
            groups={g: [layer_index(n) for n in names] for g, names in self._layers.items()},
            group_kinds={g.group_id: g.kind.value for g in self._groups},
            kv_layout=[str(first.dtype), list(first.shape[1:]), list(first.stride())])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        """After the step's forward: the named blocks hold their final KV; copy them out."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, ProbeMetadata):
            return
        if meta.fills:  # first: a hit in this same step may be served a block just written
            try:
                self._table.record(meta.fills, self._digest)
            except Exception:
                log.exception("kv-sidecar probe: write-time fingerprints failed (ignored)")
        for order in meta.captures:
            try:
                self._capture(order)
            except Exception:
                log.exception("kv-sidecar probe: capture %s failed (ignored)",
                              order.capture_id)
        now = time.monotonic()
        if meta.captures or now - self._counts_at >= _COUNTS_EVERY_S:
            self._send_counts(now)

    def _send_counts(self, now: float) -> None:
        counts = self._table.take_counts()
        self._counts_at = now
        if counts is not None:
            self._shipper.post("fingerprints", **counts)

    def _digest(self, group_id: int, block_id: int) -> str:
        """One attention block's digest in the engine's layout, where it lives."""
        return raw_digest([self._kv[name] for name in self._layers.get(group_id, [])],
                          block_id)

    def _capture(self, order: CaptureOrder) -> None:
        """On the engine's step: each block copied into a slot (a recurrent state, small,
        copied as it is decoded) and the write records read; the rest is the shipper's."""
        kv: list[Staged] = []
        writes = []
        bs = self._block_size
        lookup = {"role": order.role, "query_tokens": order.query_tokens,
                  "hit_tokens": order.hit_tokens}
        for g, index, block_id in order.refs:
            entry = self._table.get(g, block_id) if order.role == "hit" else None
            if entry is not None:  # the same digest now, next to the bytes shipped
                served = self._digest(g, block_id) if entry.digest is not None else None
                writes.append((g, index, entry.epoch, entry.digest, entry.path, served))
            layers = [self._kv[name] for name in self._layers.get(g, [])]
            spec = self._state_specs.get(g)
            if spec is not None:
                k, v = decode_state_block(layers, block_id, spec)
            else:
                slot = self._shipper.stage(g, block_views(layers, block_id, bs, self._backend))
                if slot is None:  # every slot still waits to be shipped: not taken
                    self._shipper.refuse_capture(lookup)
                    return
                k, v = slot
            kv.append((g, index, block_id, k, v))

        def build(host: list[Staged]) -> dict[str, Any]:
            return capture_fields(order.capture_id, order.role, order.salt, order.tokens,
                                  order.query_tokens, order.hit_tokens, order.blocks, host,
                                  writes)

        self._shipper.post_capture(build, kv, lookup)

    def shutdown(self) -> None:
        self._lookups.send()
        self._send_counts(time.monotonic())
        self._shipper.close()
