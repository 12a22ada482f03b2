"""Block names for engines that keep KV by token slot (SGLang-style radix trees).

The protocol names a block by ``(group_id, block_id)``. A slot engine has no blocks: a
*block* is a block_size-aligned run of a path's token slots, and the helper names it by the
slot of its **last** token (unique: a slot belongs to one node at one position; the first
slot is shared by two paths that part inside the block). ``read``/``capture`` get the id
back and need the run's slots: :class:`SlotBlocks` keeps ``block id -> slots``, filled
wherever the engine first names the block (at store time, or at hit time, since a hit can
precede the store the sidecar sees) and bounded by the pool (one entry per last slot).
"""

from __future__ import annotations

from collections.abc import Sequence


class SlotBlocks:
    """``block id -> slot run`` for a slot engine (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._runs: dict[int, tuple[int, ...]] = {}

    def name(self, path_slots: Sequence[int], start: int) -> int:
        """Name the block of ``path_slots`` (a path's slots from its first token) that
        starts at token ``start`` and remember its slots; returns its id (last slot)."""
        run = tuple(int(s) for s in path_slots[start:start + self.block_size])
        if len(run) != self.block_size:
            raise ValueError(f"no full block at token {start} of a {len(path_slots)}-slot path")
        self._runs[run[-1]] = run
        return run[-1]

    def name_all(self, path_slots: Sequence[int], first: int = 0) -> list[int]:
        """Ids of the full blocks of a path from block ``first`` on, remembered."""
        bs = self.block_size
        return [self.name(path_slots, lo)
                for lo in range(first * bs, len(path_slots) // bs * bs, bs)]

    def slots(self, block_id: int) -> tuple[int, ...] | None:
        """The block's slots, or ``None`` for an id never named (or forgotten)."""
        return self._runs.get(block_id)

    def forget(self, block_ids: Sequence[int]) -> None:
        """Freed blocks: their slots may name another block next."""
        for b in block_ids:
            self._runs.pop(b, None)

    def __getitem__(self, block_id: int) -> tuple[int, ...]:
        return self._runs[block_id]

    def __len__(self) -> int:
        return len(self._runs)
