"""vLLM behind :class:`sidecar.core.protocol.Adapter`, so the Monitor verifies vLLM hits exactly as
it verifies the reference engine's.

* ``describe()``: built from the checkpoint's ``config.json`` plus the dtype and block size
  vLLM runs with, and checked against the probe's ``hello`` when it arrives;
* no later ``read``: the sidecar cannot reach into another process's tensors, so the probe
  copies the sampled blocks out at match time and the service hands them to
  :meth:`sidecar.core.monitor.Monitor.on_captured` as the capture (``reread = False``);
* ``recompute(hit, refs)``: the configured reference (:mod:`.reference`: HF or engine-side);
* ``allocator()``: from vLLM's own metrics, through :class:`.metrics_bridge.VllmMetricsBridge`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidecar.adapters.vllm.groups import groups_from_config
from sidecar.adapters.vllm.metrics_bridge import VllmMetricsBridge
from sidecar.adapters.vllm.reference import Reference
from sidecar.adapters.vllm.wire import Capture
from sidecar.core.protocol import (
    AdapterError,
    AllocatorState,
    BlockKV,
    BlockRef,
    BlockWrite,
    EngineInfo,
    Hit,
    Lookup,
)

log = logging.getLogger(__name__)

# What vLLM's block hash covers (hashing.py), reported as the engine's key fields.
VLLM_KEY_FIELDS = ("parent_hash", "token_ids", "lora", "mm_items", "cache_salt",
                   "prompt_embeds")


def captured_hit(cap: Capture) -> tuple[Lookup, list[BlockKV]]:
    """A probe capture as the Monitor takes it: the lookup (with its hit) and the captured
    blocks, for :meth:`sidecar.core.monitor.Monitor.on_captured`."""
    hit = Hit(tokens=cap.tokens, hit_tokens=cap.hit_tokens, blocks=cap.blocks,
              key_fields=cap.key_fields, generations=cap.generations,
              tier_states=cap.tier_states)
    blocks = [BlockKV(BlockRef(g, i, int(cap.blocks[g][i])), k, v,
                      cap.kv_generations.get((g, i)))
              for (g, i), (k, v) in sorted(cap.kv.items())]
    return Lookup(cap.query_tokens, cap.hit_tokens, hit, seq_id=cap.seq_id), blocks


def captured_writes(cap: Capture) -> dict[BlockRef, BlockWrite]:
    """What the probe recorded when each captured block was written (write path, digest),
    by the same refs as :func:`captured_hit`'s blocks."""
    return {BlockRef(g, i, int(cap.blocks[g][i])): w for (g, i), w in cap.writes.items()}


# A config.json is a few KB (a vision model's tens); past this it is not one.
MAX_CHECKPOINT_CONFIG_BYTES = 4 << 20


class CheckpointError(ValueError):
    """The checkpoint directory cannot describe the engine; ``str()`` is one line naming
    it and what is wrong (the CLIs print it and exit 2)."""



def engine_info_from_checkpoint(model_dir: str, dtype: str, block_size: int,
                                model_name: str | None = None) -> EngineInfo:
    """EngineInfo for vLLM serving ``model_dir``: the cache groups vLLM builds for its
    layer kinds (:func:`.groups.groups_from_config`: full attention, sliding window,
    recurrent state; vLLM's null block 0 named in each). The probe's hello reports the
    engine's actual groups, and a mismatch is logged loudly. A directory without a
    readable model ``config.json`` is :class:`CheckpointError`."""
    from sidecar.config.toml_file import FileProblem, read_small_text

    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(read_small_text(path, "checkpoint config",
                                         MAX_CHECKPOINT_CONFIG_BYTES))
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        groups = groups_from_config(cfg)
        if dtype in ("auto", ""):
            dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    except FileProblem as exc:
        raise CheckpointError(f"--model {model_dir}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError,
            RecursionError) as exc:  # the file's content: not JSON, or not a model config
        what = f"no {exc}" if isinstance(exc, KeyError) else type(exc).__name__
        raise CheckpointError(f"--model {model_dir}: {path} is not a model config "
                              f"({what})") from None
    return EngineInfo(
        engine="vllm", model=model_name or Path(model_dir).name,
        revision=str(cfg.get("_commit_hash") or "local"), dtype=dtype.removeprefix("torch."),
        block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim, groups=groups,
        key_fields=VLLM_KEY_FIELDS)


def hello_mismatches(info: EngineInfo, hello: dict[str, Any]) -> list[str]:
    """What the engine reports differently from what the sidecar was configured with."""
    out = []
    for key, mine in (("block_size", info.block_size), ("dtype", info.dtype),
                      ("kv_heads", info.num_kv_heads), ("head_dim", info.head_dim)):
        if hello.get(key) != mine:
            out.append(f"{key}: engine {hello.get(key)!r}, sidecar {mine!r}")
    groups = {int(g): tuple(layers) for g, layers in (hello.get("groups") or {}).items()}
    mine_groups = {g.group_id: tuple(g.layers) for g in info.groups}
    if groups and groups != mine_groups:
        out.append(f"cache groups: engine {groups}, sidecar {mine_groups}")
    kinds = {int(g): str(k) for g, k in (hello.get("group_kinds") or {}).items()}
    mine_kinds = {g.group_id: g.kind.value for g in info.groups}
    if kinds and kinds != mine_kinds:
        out.append(f"cache group kinds: engine {kinds}, sidecar {mine_kinds}")
    return out


class VllmAdapter:
    """See the module docstring. ``reference`` may be swapped at run time (tests compare
    the same captured hits against both references)."""

    def __init__(self, info: EngineInfo, reference: Reference | None,
                 bridge: VllmMetricsBridge | None = None) -> None:
        self.info = info
        self.reference = reference
        self.bridge = bridge

    def describe(self) -> EngineInfo:
        return self.info

    reread = False  # blocks are copied out at match time by the probe, never read later
    @property
    def reference_kind(self) -> str:
        """The current reference's kind, for the verifier's per-reference tolerance."""
        return getattr(self.reference, "kind", "independent")

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        raise AdapterError("vLLM blocks can only be read at match time, through the probe's "
                           "capture (Monitor.on_captured)")

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        if self.reference is None:
            raise AdapterError("no recompute reference configured")
        return self.reference.recompute(hit, refs)

    def allocator(self) -> AllocatorState | None:
        return self.bridge.poll() if self.bridge is not None else None
