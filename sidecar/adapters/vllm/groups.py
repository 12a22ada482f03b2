"""vLLM's KV-cache groups as the sidecar's :class:`~sidecar.core.protocol.CacheGroup` list, and the
per-group block choice for a sampled hit.

A hybrid model in vLLM has one KV-cache group per kind of layer (``kv_cache_groups`` of its
``KVCacheConfig``): full attention, sliding window (Gemma2/Gemma3), or a recurrent state
(a Mamba-style spec: LFM2's short-convolution state). Every group has its own block table;
blocks a group does not need (before a sliding window, before the last boundary of a
recurrent group) are vLLM's null block 0. The groups are known twice, and must agree:

* from the checkpoint's ``config.json`` (:func:`groups_from_config`), when the sidecar
  starts — before the engine has said anything;
* from the engine's own ``KVCacheConfig`` (:func:`groups_from_specs`), in the probe, which
  reports them in its ``hello`` (kinds included), where a mismatch is logged loudly.

vLLM orders its groups by first appearance of each kind in layer order (the layers of one
kind are one group here: these tiny models have as many layers of each kind), which
:func:`groups_from_config` reproduces.

Block choice (:func:`choose_group_blocks`, the core's :func:`sidecar.core.sampling.choose_blocks`)
follows :func:`sidecar.checks.group_coverage.required_blocks` group by group: each group's last
required
block, plus earlier *required* blocks in rotation — never a null block.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.core.protocol import BlockRef, CacheGroup, GroupKind, Hit
from sidecar.core.sampling import BlockCursors, choose_blocks

VLLM_NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null (padding) block
NULL_BLOCKS = frozenset({VLLM_NULL_BLOCK})

# config.json layer type -> group kind (Gemma2/3 and LFM2 spellings).
_LAYER_KINDS = {
    "full_attention": GroupKind.FULL_ATTENTION, "attention": GroupKind.FULL_ATTENTION,
    "sliding_attention": GroupKind.SLIDING_WINDOW, "sliding_window": GroupKind.SLIDING_WINDOW,
    "conv": GroupKind.RECURRENT_STATE, "linear_attention": GroupKind.RECURRENT_STATE,
    "mamba": GroupKind.RECURRENT_STATE,
}
_GROUP_NAMES = {GroupKind.FULL_ATTENTION: "full", GroupKind.SLIDING_WINDOW: "sliding",
                GroupKind.RECURRENT_STATE: "recurrent"}


class UnsupportedModel(ValueError):
    """A layer kind the vLLM adapter cannot verify yet (named in the message)."""


def layer_kinds(cfg: Mapping[str, Any]) -> list[GroupKind]:
    """The group kind of each layer of a checkpoint config (``text_config`` already taken)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None and cfg.get("model_type") == "gemma2":  # older configs: even = sliding
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if types is None:
        return [GroupKind.FULL_ATTENTION] * n
    kinds = []
    for t in types:
        kind = _LAYER_KINDS.get(str(t))
        if kind is None:
            raise UnsupportedModel(f"layer type {t!r} is not one the vLLM adapter verifies "
                                   f"(known: {sorted(_LAYER_KINDS)})")
        kinds.append(kind)
    if kinds and GroupKind.SLIDING_WINDOW in kinds and not cfg.get("sliding_window"):
        kinds = [GroupKind.FULL_ATTENTION if k is GroupKind.SLIDING_WINDOW else k
                 for k in kinds]  # a null window means every layer attends fully
    return kinds


def groups_from_config(cfg: Mapping[str, Any]) -> tuple[CacheGroup, ...]:
    """The cache groups vLLM builds for a checkpoint config: one per layer kind, in order of
    the kind's first layer; every group's null block is vLLM's block 0."""
    kinds = layer_kinds(cfg)
    order: list[GroupKind] = []
    for k in kinds:
        if k not in order:
            order.append(k)
    window = cfg.get("sliding_window")
    return tuple(
        CacheGroup(gid, kind, tuple(i for i, k in enumerate(kinds) if k is kind),
                   sliding_window=int(window) if kind is GroupKind.SLIDING_WINDOW and window
                   else None,
                   name=_GROUP_NAMES[kind], null_block_ids=NULL_BLOCKS)
        for gid, kind in enumerate(order))


def spec_kind(spec: Any) -> tuple[GroupKind, int | None]:
    """A vLLM ``KVCacheSpec`` as (group kind, sliding window). Read by class name and
    attributes, so this module imports nothing from vLLM."""
    name = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    if "Mamba" in name or hasattr(spec, "shapes"):
        return GroupKind.RECURRENT_STATE, None
    if "SlidingWindow" in name or window:
        return GroupKind.SLIDING_WINDOW, int(window) if window else None
    return GroupKind.FULL_ATTENTION, None


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """A vLLM layer name's number (``model.layers.7.self_attn.attn`` -> 7; 0 without)."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else 0


def group_layer_names(kv_cache_config: Any) -> dict[int, list[str]]:
    """Each KV-cache group's layer names, by group id (``KVCacheConfig.kv_cache_groups``)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return {g: list(spec.layer_names) for g, spec in enumerate(groups)}


def groups_from_specs(kv_cache_config: Any, layer_index: Any) -> list[tuple[CacheGroup,
                                                                             list[str]]]:
    """The engine's own groups (``KVCacheConfig.kv_cache_groups``), each with its layer
    names; ``layer_index(name)`` gives a layer's number."""
    out = []
    for gid, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        kind, window = spec_kind(g.kv_cache_spec)
        names = sorted(g.layer_names, key=layer_index)
        out.append((CacheGroup(gid, kind, tuple(layer_index(n) for n in names),
                               sliding_window=window, name=_GROUP_NAMES[kind],
                               null_block_ids=NULL_BLOCKS), names))
    return out


def choose_group_blocks(hit: Hit, groups: Sequence[CacheGroup], block_size: int,
                        max_blocks: int, rng: random.Random,
                        cursors: BlockCursors | None = None) -> list[BlockRef]:
    """Per group: the last block the group must hold for this hit, plus up to
    ``max_blocks - 1`` earlier ones among those it must hold
    (:func:`sidecar.checks.group_coverage.required_blocks`), rotating through them with ``cursors``.
    The core's chooser (:func:`sidecar.core.sampling.choose_blocks`), which the probe uses too:
    null blocks are never chosen (one at a required position is found by the verifier's
    coverage check over the whole hit)."""
    return choose_blocks(hit, block_size, max_blocks, rng, groups=groups, cursors=cursors)
