"""The radix-cache backend SGLang loads: the tree it would have built, with the tap on it.

SGLang's public hook for a tree is ``register_radix_cache_backend(name, factory)`` plus
``--radix-cache-backend NAME``; its general-plugin entry point (``sglang.srt.plugins``) runs
:func:`register` in every SGLang process, so ``pip install kv-sidecar`` beside SGLang is the
whole install. The factory builds exactly what SGLang's default selection chain builds
(:func:`default_radix_cache_factory`: ``UnifiedRadixCache`` on its Rust core here) and
wraps the hook methods of that one tree instance and its allocator of full-pool slots (on a
hybrid SWA server, the full sub-allocator: :func:`slot_allocator`): each
wrapper calls SGLang's method and then tells :class:`.tap.SglangTap`. Wrapping on the
instance (not a proxy object, not a subclass) keeps every ``isinstance(cache,
UnifiedRadixCache)`` check in SGLang true and leaves each method's behaviour unchanged; no
SGLang class or module is patched.

Hooks (all ``try``/``except`` around the tap: nothing crosses into SGLang):

* ``insert`` -> stores (the tree's own path slots after the insert, so a block's slots are
  the ones a later match serves);
* ``checkpoint`` (a request's first one, right after its prefill) -> the lookup, and for a
  sampled hit the K/V of the chosen blocks, read while the request still holds them;
  ``on_release`` forgets the request;
* allocator ``alloc``/``free`` (also reached by eviction and by the tree's duplicate frees)
  -> allocation failures, frees of stored blocks, the tap's own allocated-slot map;
  ``clear`` (a cache flush) -> every stored block freed, the map reset;
* at most once per ``census_every_s`` (and at most ``census_share`` of SGLang's time, the
  census's own cost counted), at a match (the scheduler admitting a request:
  between tree operations), a checkpoint or a release: the pool census (frees SGLang is
  still holding in a free group count as free, and as no longer handed out).

A hybrid SWA server (sliding-window and full layers in two pools) is tapped in both: the
tap's cache groups (:func:`pool_groups`) read the sliding layers' K/V through SGLang's
full-to-SWA slot mapping. Pure-SWA servers, per-request SWA rings, Mamba trees and HiCache
are refused with a line naming them.

Configured by one environment variable, ``KVSIDECAR_SGLANG_TAP``, a JSON object:
``endpoint`` (required: the sidecar's probe socket), ``block_size`` (16), ``sample_every``
(100), ``blocks_per_sample`` (2), ``seed`` (0), ``census_every_s`` (1.0), ``census_share``
(0.002), ``pipe_hwm`` (256).
"""

from __future__ import annotations

import logging
import os
from time import perf_counter_ns as clock
from typing import TYPE_CHECKING, Any

from sidecar.adapters.peer_settings import Setting, check_settings, parse_settings

if TYPE_CHECKING:  # the tap loads torch: imported where a tree is built, not by `--help`
    from sidecar.adapters.sglang.tap import PoolGroup, SglangTap

log = logging.getLogger(__name__)

BACKEND_NAME = "kv-sidecar"
CONFIG_ENV = "KVSIDECAR_SGLANG_TAP"
SUPPORTED_SGLANG: tuple[str, ...] = ("0.5.23",)


# The tap's settings (sidecar.adapters.peer_settings): key -> (type, lowest, highest,
# default), checked whole when SGLang builds its tree.
TAP_KEYS: dict[str, Setting] = {
    "block_size": (int, 1, 4096, 16),
    "sample_every": (int, 1, 1 << 40, 100),
    "blocks_per_sample": (int, 1, 1024, 2),
    "seed": (int, 0, (1 << 63) - 1, 0),
    "census_every_s": (float, 0.0, 86_400.0, 1.0),  # 0: at every chance (the tests)
    "census_share": (float, 0.0, 1.0, 0.002),  # of SGLang's time at most (0: no limit)
    "pipe_hwm": (int, 1, 1 << 20, 256),
}


def tap_config() -> dict[str, Any]:
    """``KVSIDECAR_SGLANG_TAP`` parsed and checked: ``endpoint`` plus every key of
    :data:`TAP_KEYS` (defaults filled in); ValueError naming each problem otherwise."""
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        raise ValueError(f"kv-sidecar's SGLang backend needs {CONFIG_ENV}, a JSON object "
                         "with at least 'endpoint' (the sidecar's probe socket, e.g. "
                         "ipc:///tmp/kvsidecar-sglang.sock)")
    return check_settings(parse_settings(raw, CONFIG_ENV), TAP_KEYS, CONFIG_ENV)


def check_sglang_version(found: str) -> None:
    if found.split("+", 1)[0] not in SUPPORTED_SGLANG:
        raise RuntimeError(f"kv-sidecar's SGLang backend supports SGLang "
                           f"{', '.join(SUPPORTED_SGLANG)}, found {found}: it reads the "
                           "tree's and the KV pool's private layout")


def make_tap(ctx: Any) -> SglangTap:
    import sglang

    from sidecar.adapters.sglang.tap import PoolGroup, SglangTap

    check_sglang_version(sglang.__version__)
    cfg = tap_config()
    params = ctx.params
    if int(params.page_size) != 1:
        raise ValueError("kv-sidecar's SGLang backend is tested with --page-size 1 only")
    allocator = params.token_to_kv_pool_allocator
    if ctx.is_hybrid_swa and ctx.full_tokens_per_layer == 0:
        raise ValueError("kv-sidecar's SGLang backend: a pure-SWA server (no full-attention "
                         "layer) is not tapped")
    groups = pool_groups(allocator, params.sliding_window_size) if ctx.is_hybrid_swa \
        else [PoolGroup.full(_mha(allocator.get_kvcache()))]
    tap = SglangTap(cfg["endpoint"], cfg["block_size"], cfg["sample_every"],
                    cfg["blocks_per_sample"], cfg["seed"], cfg["census_every_s"],
                    cfg["pipe_hwm"], cfg["census_share"])
    tap.attach(groups, int(slot_allocator(allocator).size), sglang.__version__,
               str(getattr(ctx.model_config, "model_path", "")))
    return tap


def slot_allocator(allocator: Any) -> Any:
    """The allocator of full-pool slots: SGLang's own on a full-attention server; on a
    hybrid SWA server its full sub-allocator, which every allocation and free of a full
    slot reaches (the hybrid's ``alloc_extend``/``free_full`` call it directly)."""
    return getattr(allocator, "full_attn_allocator", None) or allocator


def _mha(pool: Any) -> Any:
    """``pool`` if it is the NHD MHA pool the tap reads (per-layer ``k_buffer``)."""
    if getattr(pool, "kv_cache_layout", "nhd") != "nhd" or not hasattr(pool, "k_buffer"):
        raise ValueError(f"kv-sidecar's SGLang backend reads the NHD MHA pool, got "
                         f"{type(pool).__name__} ({getattr(pool, 'kv_cache_layout', '?')})")
    return pool


def pool_groups(allocator: Any, window: int | None) -> list[PoolGroup]:
    """A hybrid SWA server's two groups: the full layers in the full pool, the sliding
    layers in the SWA pool, which a full slot reaches through SGLang's
    ``full_to_swa_index_mapping`` (0 once SGLang tombstoned the slot's SWA K/V). Group ids
    in order of each kind's first layer, as the sidecar numbers a checkpoint's groups.
    ``window``: SGLang's sliding window (it attends to ``window`` tokens before the query:
    the checkpoint's ``sliding_window`` less one)."""
    from sidecar.adapters.sglang.tap import PoolGroup
    from sidecar.core.protocol import CacheGroup, GroupKind

    if getattr(allocator, "_swa_req_ring", False):
        raise ValueError("kv-sidecar's SGLang backend reads paged SWA slots; this server "
                         "keeps SWA K/V in a per-request ring")
    if not window:
        raise ValueError("kv-sidecar's SGLang backend: a hybrid SWA server without a "
                         "sliding window size")
    kv = allocator.get_kvcache()
    full, swa = _mha(kv.full_kv_pool), _mha(kv.swa_kv_pool)
    full_layers, swa_layers = tuple(full.model_layer_ids), tuple(swa.model_layer_ids)
    mapping = allocator.full_to_swa_index_mapping

    def to_swa(slots: Any) -> Any:
        return mapping[slots.to(mapping.device)]

    full_id, swa_id = (1, 0) if min(swa_layers) < min(full_layers) else (0, 1)
    nulls = frozenset({0})
    return [
        PoolGroup(CacheGroup(full_id, GroupKind.FULL_ATTENTION, full_layers, name="full",
                             null_block_ids=nulls), full),
        PoolGroup(CacheGroup(swa_id, GroupKind.SLIDING_WINDOW, swa_layers,
                             sliding_window=int(window) + 1, name="sliding",
                             null_block_ids=nulls), swa, to_swa),
    ]


def tapped_tree(ctx: Any) -> Any:
    """The factory: SGLang's default tree for ``ctx``, tapped."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    if ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("kv-sidecar's SGLang backend taps full-attention and sliding-window "
                         "trees without HiCache only (Mamba and host tiers are not verified "
                         "yet)")
    tap = make_tap(ctx)
    tree = default_radix_cache_factory(ctx)
    return attach(tree, tap)


def attach(tree: Any, tap: SglangTap) -> Any:
    """Wrap ``tree``'s and its allocator's hook methods, on the instances, so they report
    to ``tap``. Instance attributes shadow the class's methods, so SGLang's own calls
    (``self.insert`` inside ``checkpoint``, ``self.free`` inside ``free_group_end``) go
    through the wrappers too; the class, and every ``isinstance`` check, stay SGLang's."""
    from sidecar.adapters.sglang.key_values import key_fields

    allocator = slot_allocator(tree.token_to_kv_pool_allocator)
    alloc, free = allocator.alloc, allocator.free
    # Each hook adds the time its own work took (SGLang's wrapped call excluded) to
    # tap.busy_ns: the tap's cost on SGLang's thread, exported beside SGLang's CPU.

    def alloc_hook(need_size: int) -> Any:
        out = alloc(need_size)
        t0 = clock()
        tap.allocated(out)
        tap.busy_ns += clock() - t0
        return out

    def free_hook(free_index: Any) -> Any:
        out = free(free_index)
        t0 = clock()
        if getattr(allocator, "free_group", None) is None:  # not deferred: freed now
            tap.freed(free_index)
        tap.busy_ns += clock() - t0
        return out

    clear = allocator.clear

    def clear_hook() -> Any:  # /flush_cache: every slot free again, the tree reset
        out = clear()
        t0 = clock()
        tap.cleared()
        tap.busy_ns += clock() - t0
        return out

    allocator.alloc, allocator.free, allocator.clear = alloc_hook, free_hook, clear_hook
    insert, checkpoint, on_release = tree.insert, tree.checkpoint, tree.on_release
    match_prefix = tree.match_prefix

    def match_hook(params: Any) -> Any:
        t0 = clock()
        _census(tree, tap)  # before scheduling a request: no free group open
        tap.busy_ns += clock() - t0
        return match_prefix(params)

    def insert_hook(params: Any) -> Any:
        result = insert(params)
        t0 = clock()
        try:
            key = params.key
            prefix_len = int(result.prefix_len)
            # Only an insert that completes a block past what the tree had stores one: the
            # path (SGLang concatenates its nodes' slots) is asked for then only (most
            # inserts of a chat, a request's unfinished and finished caching, add none).
            if key is not None and not getattr(key, "is_bigram", False) and \
                    len(key) // tap.block_size * tap.block_size > prefix_len:
                path = tree.path_device_indices(result.last_device_node)
                tap.inserted(key.raw_token_ids(), path, prefix_len,
                             key_fields(key.extra_key, key.cache_salt))
        except Exception:
            tap._failed("insert hook")
        tap.busy_ns += clock() - t0
        return result

    def checkpoint_hook(req: Any, *, up_to: int, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            if req.rid not in tap._admitted:
                hit = int(getattr(req, "cached_tokens", 0) or 0)
                row = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
                # The prompt and the slot row as SGLang keeps them: sliced and copied (off
                # a GPU: a device sync) only for a sampled hit.
                tap.admitted(req.rid, req.origin_input_ids, hit, row,
                             key_fields(req.extra_key, req.cache_salt))
        except Exception:
            tap._failed("checkpoint hook")
        t1 = clock()
        out = checkpoint(req, up_to=up_to, **kwargs)
        t2 = clock()
        _census(tree, tap)
        tap.busy_ns += t1 - t0 + clock() - t2
        return out

    def on_release_hook(req: Any, *, checkpointed: bool) -> Any:
        out = on_release(req, checkpointed=checkpointed)
        t0 = clock()
        try:
            if req.rid not in tap._admitted:  # released without a checkpoint (aborted)
                tap.admitted(req.rid, list(req.origin_input_ids), 0, _empty(),
                             key_fields(req.extra_key, req.cache_salt))
            tap.released(req.rid)
        except Exception:
            tap._failed("release hook")
        _census(tree, tap, releasing=True)
        tap.busy_ns += clock() - t0
        return out

    tree.insert, tree.checkpoint, tree.on_release = insert_hook, checkpoint_hook, on_release_hook
    tree.match_prefix = match_hook
    tree._kvs_tap = tap
    return tree


def _census(tree: Any, tap: SglangTap, releasing: bool = False) -> None:
    """The pool census, when due (SGLang's structures read on its own thread).
    ``releasing``: from a request's release, after SGLang freed its KV but before it frees
    the request's row: the last one out counts as idle, and its census is due within the
    cost budget alone (:meth:`SglangTap.census_due`), so a server that goes quiet is
    censused idle (the leak check) rather than left at the last busy census. The request
    pool is read only then, or for a census that runs (not at every hook)."""
    try:
        req_pool = tree.req_to_token_pool
        quiet = releasing and req_pool.available_size() + 1 == req_pool.size
        if not tap.census_due(quiet=quiet):
            return
        idle = quiet or (not releasing and req_pool.available_size() == req_pool.size)
        allocator = slot_allocator(tree.token_to_kv_pool_allocator)
        free = allocator.get_all_free_pages()
        pending = getattr(allocator, "free_group", None)
        held_back = None
        if pending:  # inside a free group: SGLang holds these frees until the group ends
            import torch

            held_back = torch.cat(pending)
            free = torch.cat([free, held_back])
        tap.census(free, tree.all_values_flatten(), int(tree.evictable_size()),
                   int(tree.protected_size()), idle, held_back)
    except Exception:
        tap._failed("census hook")


def _empty() -> Any:
    import torch

    return torch.zeros(0, dtype=torch.int64)


def register() -> None:
    """SGLang general-plugin entry point: make ``--radix-cache-backend kv-sidecar`` known,
    and check the tap's settings when SGLang resolves its flags (:func:`check_launch`).
    Never raises (a broken sidecar install must not stop SGLang unless it is selected)."""
    try:
        from sglang.srt.mem_cache.registry import (
            register_radix_cache_backend,
            registered_radix_cache_backends,
        )

        if BACKEND_NAME not in registered_radix_cache_backends():
            register_radix_cache_backend(BACKEND_NAME, tapped_tree)
    except Exception:
        log.exception("kv-sidecar: could not register the SGLang radix-cache backend")
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(LAUNCH_CHECK_TARGET, check_launch, HookType.BEFORE)
    except Exception:  # another SGLang: the settings are still checked at the tree's build
        log.debug("kv-sidecar: no launch check (SGLang's hook registry not found)",
                  exc_info=True)


# SGLang 0.5.23 resolves its flags here, in the launching process, before any scheduler runs.
LAUNCH_CHECK_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"


def check_launch(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Before SGLang resolves its flags: with ``--radix-cache-backend kv-sidecar`` (or a
    backend named after it), the SGLang version and ``KVSIDECAR_SGLANG_TAP`` are checked,
    and a refusal stops the launch with one line (``SystemExit``, exit status 1). Checked
    only when the tree was built, a refused setting came as a scheduler's traceback, then
    SGLang killing its processes (exit 137)."""
    name = getattr(server_args, "radix_cache_backend", None)
    if not (isinstance(name, str) and name.startswith(BACKEND_NAME)):
        return None
    try:
        import sglang

        check_sglang_version(sglang.__version__)
        tap_config()
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"kv-sidecar (--radix-cache-backend {name}): {exc}") from None
    return None
