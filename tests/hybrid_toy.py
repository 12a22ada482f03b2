"""A tiny synthetic hybrid engine + adapter: full-attention, sliding-window and recurrent
cache groups over a deterministic "model", with null blocks and offload-tier states.

Stands in for the hybrid reference engine (issue 11, built in parallel) so the sidecar's
per-group checks are proven now. Like vLLM's hybrid manager:

* every group has its own pool and block ids; id 0 is each pool's null (padding) block;
* a hit lists every group's block table over the hit's full blocks: the full group real
  blocks everywhere, the sliding group real blocks only inside its window (null before it),
  the recurrent group real state only at the hit's last boundary (null elsewhere);
* a recurrent block ``i`` holds the state after token ``(i + 1) * BS - 1`` (key: the state
  ``(layers, 3, 5)``, value: a second component ``(layers, 4)``).

The "model" maps (group, token prefix) to KV with a seeded generator, so recompute is exact
up to a dtype-sized noise the adapter adds (a real recompute is never bit-exact): tests
corrupt ``engine.pool`` or the engine's tables and know what must be flagged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import (
    AllocatorState,
    BlockKV,
    BlockRef,
    CacheGroup,
    EngineInfo,
    GroupKind,
    Hit,
    Lookup,
    StoredBlock,
    TierState,
)
from tests.limits import DETECTION_TIMEOUT_S

BS, HEADS, DIM = 4, 2, 8
FULL, SLIDING, RECURRENT = 0, 1, 2
WINDOW = 2 * BS + 1  # a hit needs the sliding group's last two blocks
NULL = 0
LAYERS = {FULL: (0, 1), SLIDING: (2, 3), RECURRENT: (4, 5)}
STATE, STATE2 = (3, 5), (4,)
NOISE = {torch.float32: 1e-6, torch.bfloat16: 2e-3}  # recompute noise, relative
PROMPT = list(range(100, 124))  # 6 full blocks


def groups() -> tuple[CacheGroup, ...]:
    return (CacheGroup(FULL, GroupKind.FULL_ATTENTION, LAYERS[FULL], name="full"),
            CacheGroup(SLIDING, GroupKind.SLIDING_WINDOW, LAYERS[SLIDING], WINDOW,
                       name="swa", null_block_ids=frozenset({NULL})),
            CacheGroup(RECURRENT, GroupKind.RECURRENT_STATE, LAYERS[RECURRENT],
                       name="conv", null_block_ids=frozenset({NULL})))


def model_kv(group: int, tokens: Sequence[int], index: int,
             noise: float = 0.0, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV (or recurrent state) of ``group`` for block ``index`` of ``tokens``."""
    seed = hash((group, tuple(tokens[:(index + 1) * BS]))) % 2**31
    g = torch.Generator().manual_seed(seed)
    jitter = torch.Generator().manual_seed(seed + 1)  # the recompute's own rounding noise
    n = len(LAYERS[group])
    shapes = ((n, *STATE), (n, *STATE2)) if group == RECURRENT else \
        ((n, HEADS, BS, DIM), (n, HEADS, BS, DIM))
    out = []
    for shape in shapes:
        t = torch.randn(*shape, generator=g)
        if noise:
            t = t * (1 + noise * torch.randn(*shape, generator=jitter))
        out.append(t.to(dtype))
    return out[0], out[1]


class HybridToyEngine:
    """Stores every full block in every group; serves hits as a hybrid manager would."""

    def __init__(self, sink, dtype: torch.dtype = torch.float32) -> None:
        self.sink = sink
        self.dtype = dtype
        self.pool: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.gen: dict[tuple[int, int], int] = {}
        self.index: dict[tuple[int, ...], dict[int, int]] = {}  # prefix -> group -> id
        self.next_id = {g: 1 for g in LAYERS}  # 0 is the null block
        self.tier: dict[tuple[int, int], TierState] = {}  # blocks that came through a tier
        self.last_hit: Hit | None = None

    def table(self, tokens: Sequence[int], n_full: int) -> dict[int, list[int]]:
        """Each group's block table for the hit's first ``n_full`` blocks."""
        first_in_window = max(0, n_full * BS - (WINDOW - 1)) // BS
        ids = [self.index[tuple(tokens[:(i + 1) * BS])] for i in range(n_full)]
        return {FULL: [b[FULL] for b in ids],
                SLIDING: [b[SLIDING] if i >= first_in_window else NULL
                          for i, b in enumerate(ids)],
                RECURRENT: [b[RECURRENT] if i == n_full - 1 else NULL
                            for i, b in enumerate(ids)]}

    def serve(self, tokens: list[int], edit=None) -> Hit | None:
        """One request: look up, hand the hit (after ``edit(blocks, tier_states)``, where a
        test breaks the tables) to the sink, store the rest."""
        n_full = 0
        while n_full < len(tokens) // BS and tuple(tokens[:(n_full + 1) * BS]) in self.index:
            n_full += 1
        hit = None
        if n_full:
            blocks = self.table(tokens, n_full)
            states = {g: [self.tier.get((g, b)) for b in ids]  # None: resident, no padding
                      for g, ids in blocks.items() if any((g, b) in self.tier for b in ids)}
            if edit is not None:
                edit(blocks, states)
            gens = {g: [self.gen.get((g, b), 0) for b in ids] for g, ids in blocks.items()}
            hit = Hit(tuple(tokens), n_full * BS, blocks, gens, tier_states=states)
        self.last_hit = hit
        self.sink.on_lookup(Lookup(len(tokens), n_full * BS, hit))
        parents: dict[int, int | None] = {g: None for g in LAYERS}
        if n_full:
            last = self.index[tuple(tokens[:n_full * BS])]
            parents = {g: last[g] for g in LAYERS}
        for i in range(n_full, len(tokens) // BS):
            ids = {}
            for g in LAYERS:
                b = ids[g] = self.next_id[g]
                self.next_id[g] += 1
                self.gen[(g, b)] = self.gen.get((g, b), 0) + 1
                self.pool[(g, b)] = model_kv(g, tokens, i, dtype=self.dtype)
                self.sink.on_store(StoredBlock(g, b, self.gen[(g, b)],
                                               tokens[i * BS:(i + 1) * BS], i * BS,
                                               parent_block_id=parents[g]))
                parents[g] = b
            self.index[tuple(tokens[:(i + 1) * BS])] = ids
        return hit

    def block(self, group: int, tokens: Sequence[int], index: int) -> int:
        return self.index[tuple(tokens[:(index + 1) * BS])][group]


class HybridToyAdapter:
    """Reads the toy's pools; recomputes from the model with a dtype-sized noise.
    ``bad_layout`` names a group whose reads come back transposed (a wrong view)."""

    def __init__(self, engine: HybridToyEngine) -> None:
        self.engine = engine
        self.bad_layout: int | None = None
        self.recompute_calls = 0

    def describe(self) -> EngineInfo:
        return EngineInfo("hybrid-toy", "toy-hybrid", "r1",
                          str(self.engine.dtype).removeprefix("torch."), BS, HEADS, DIM,
                          groups())

    def read(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        out = []
        for r in refs:
            k, v = self.engine.pool[(r.group_id, r.block_id)]
            if r.group_id == self.bad_layout:
                k, v = k.transpose(-1, -2), v.transpose(-1, -2)
            out.append(BlockKV(r, k.clone(), v.clone(),
                               self.engine.gen[(r.group_id, r.block_id)]))
        return out

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        self.recompute_calls += 1
        dt = self.engine.dtype
        return [BlockKV(r, *model_kv(r.group_id, hit.tokens, r.index, NOISE[dt], dt))
                for r in refs]

    def allocator(self) -> AllocatorState | None:
        return None


def make(dtype: torch.dtype = torch.float32, **config) -> tuple[HybridToyEngine,
                                                                 HybridToyAdapter, Monitor]:
    """A toy engine wired to a Monitor that verifies every hit inline, every block."""
    engine = HybridToyEngine(sink=None, dtype=dtype)
    adapter = HybridToyAdapter(engine)
    cfg = SidecarConfig(**{"sample_every": 1, "blocks_per_sample": 8, "dispatch": "inline",
                           "recompute_tokens_per_s": 0, "adapter_timeout_s": DETECTION_TIMEOUT_S,
                           "allocator_every_s": 0, **config})
    monitor = Monitor(adapter, cfg)
    engine.sink = monitor
    return engine, adapter, monitor
