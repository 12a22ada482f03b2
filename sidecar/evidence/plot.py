"""Where a block is wrong, as a picture: ``kv-sidecar evidence show ID --plot out.png``.

The recompute check condemns a block on ``max|cached - recomputed| / rms(recomputed)``
(:mod:`sidecar.checks.recompute`, per block, K and V apart). The plot shows that same
quantity before the max: per layer (tile row), KV head (tile column) and token (cell column),
with K and V as the two cell rows of each tile, each cell the largest over ``head_dim``. The
colour bar beside it marks the tolerance: cells below it are shades of blue, cells above it
run red to yellow, so the wrong positions stand out at a glance.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sidecar.evidence.png import RGB, Canvas, text_width

LEVELS = 256
BACKGROUND: RGB = (255, 255, 255)
# A picture a person can read, drawn in seconds: 126 layers x 8 KV heads x 2 x 512 tokens
# fits; 2,000 x 2,000 heads (which once took 193 s and 3.3 GB) is refused up front.
MAX_PLOT_CELLS = 2**20
MAX_PLOT_PIXELS = 24 * 2**20
TENSOR_NAME = re.compile(r"^g(\d{1,9})\.b(\d{1,9})\.(cached|recomputed)\.(key|value)$")


class NothingToPlot(ValueError):
    """The record has no cached/recomputed pair to compare, or one too large or malformed
    to draw (explains why)."""


@dataclass(frozen=True)
class Heat:
    """Normalised |cached - recomputed| of one group's condemned blocks, side by side.

    ``values`` has shape ``(layers, heads, 2, tokens)`` (index 2: K, V); ``blocks`` the hit
    positions of the blocks in token order, ``block_tokens`` the tokens of each."""

    values: torch.Tensor
    group: int
    blocks: tuple[int, ...]
    block_tokens: int
    tolerance: float | None


def heat_from_tensors(tensors: Mapping[str, torch.Tensor],
                      tolerance: float | None) -> Heat:
    """The heat of the first group (lowest id) that has both cached and recomputed KV."""
    pairs: dict[int, list[int]] = {}
    for name in tensors:
        m = TENSOR_NAME.match(name)
        if m is None:
            raise NothingToPlot(f"tensor {name[:80]!r} is not named "
                                "g<group>.b<index>.<cached|recomputed>.<key|value>")
        if m.group(3) == "recomputed" and m.group(4) == "key":
            g, b = int(m.group(1)), int(m.group(2))
            if f"g{g}.b{b}.cached.key" in tensors:
                pairs.setdefault(g, []).append(b)
    if not pairs:
        raise NothingToPlot("no block in this record has a recomputed reference (it was "
                            "condemned by an earlier check, before the recompute ran)")
    group = min(pairs)
    blocks = tuple(sorted(pairs[group]))
    _check_size(tensors, group, blocks)
    columns = []
    for b in blocks:
        per_kv = []
        for part in ("key", "value"):
            cached = tensors[f"g{group}.b{b}.cached.{part}"].float()
            ref = tensors[f"g{group}.b{b}.recomputed.{part}"].float()
            if cached.shape != ref.shape or cached.dim() != 4:
                raise NothingToPlot(f"block {b} {part}: cached {tuple(cached.shape)} vs "
                                    f"recomputed {tuple(ref.shape)}: not comparable")
            rms = float(torch.linalg.vector_norm(ref)) / max(ref.numel(), 1) ** 0.5
            diff = (cached - ref).abs().nan_to_num(nan=float("inf"))
            per_kv.append(diff.amax(dim=3) / (rms + 1e-12))  # (layers, heads, tokens)
        columns.append(torch.stack(per_kv, dim=2))  # (layers, heads, 2, tokens)
    values = torch.cat(columns, dim=3)
    return Heat(values, group, blocks, int(columns[0].shape[3]), tolerance)


def _check_size(tensors: Mapping[str, torch.Tensor], group: int,
                blocks: tuple[int, ...]) -> None:
    """Refuse, before any arithmetic, a heat map too large to compute and draw."""
    cells = 0
    grid: tuple[int, ...] | None = None
    for b in blocks:
        for side in ("cached", "recomputed"):
            for part in ("key", "value"):
                shape = tuple(tensors[f"g{group}.b{b}.{side}.{part}"].shape)
                if len(shape) != 4:
                    raise NothingToPlot(f"block {b} {side} {part} has shape {shape}: "
                                        "expected (layers, heads, tokens, head_dim)")
        layers, heads, tokens, _ = tensors[f"g{group}.b{b}.cached.key"].shape
        if grid is not None and grid != (layers, heads, tokens):
            raise NothingToPlot(f"block {b} has {layers} layers x {heads} heads x {tokens} "
                                f"tokens, the blocks before it {grid}: not one picture")
        grid = (layers, heads, tokens)
        cells += layers * heads * 2 * tokens
        if cells > MAX_PLOT_CELLS:
            raise NothingToPlot(f"too large to plot: {len(blocks)} block(s) of {layers} "
                                f"layers x {heads} heads x {tokens} tokens is more than "
                                f"{MAX_PLOT_CELLS} cells (read the tensors with any "
                                "safetensors reader instead)")


def palette(tol_fraction: float) -> list[RGB]:
    """``LEVELS`` colours from 0 to the scale's top; levels up to ``tol_fraction`` of the
    scale are blues (within tolerance), levels above are red through yellow (over it)."""
    out: list[RGB] = []
    t = min(max(tol_fraction, 0.0), 1.0)
    for i in range(LEVELS):
        f = i / (LEVELS - 1)
        if f <= t and t > 0:
            u = f / t
            out.append((int(235 - 185 * u), int(240 - 140 * u), int(250 - 60 * u)))
        else:
            u = (f - t) / (1 - t) if t < 1 else 1.0
            out.append((int(200 + 55 * u), int(20 + 220 * u), int(20 + 100 * u * u)))
    return out


@dataclass(frozen=True)
class Layout:
    """Where everything is in the picture (the test reads cells back through it)."""

    layers: int
    heads: int
    tokens: int
    cell_w: int
    cell_h: int
    gap: int
    grid_x: int
    grid_y: int
    bar_x: int
    bar_y: int
    bar_h: int
    width: int
    height: int

    @property
    def tile_w(self) -> int:
        return self.tokens * self.cell_w

    @property
    def tile_h(self) -> int:
        return 2 * self.cell_h

    def cell_origin(self, layer: int, head: int, kv: int, token: int) -> tuple[int, int]:
        x = self.grid_x + head * (self.tile_w + self.gap) + token * self.cell_w
        y = self.grid_y + layer * (self.tile_h + self.gap) + kv * self.cell_h
        return x, y


def layout(layers: int, heads: int, tokens: int, title: list[str] | None = None) -> Layout:
    title = title or []
    gap = 6
    cell_w = max(1, min(12, (1200 // max(heads, 1) - gap) // max(tokens, 1)))
    cell_h = max(1, min(12, (1000 // max(layers, 1) - gap) // 2))
    grid_x = 12 + text_width("L00 K")
    grid_y = 12 + len(title) * 14 + 16
    grid_w = heads * (tokens * cell_w + gap) - gap
    grid_h = layers * (2 * cell_h + gap) - gap
    bar_x = grid_x + grid_w + 24
    bar_h = max(grid_h, 160)
    width = max(bar_x + 20 + text_width("TOL 0.000E+00", 1) + 12,
                24 + max((text_width(line) for line in title), default=0))
    height = grid_y + max(grid_h, bar_h) + 12
    return Layout(layers, heads, tokens, cell_w, cell_h, gap, grid_x, grid_y, bar_x,
                  grid_y, bar_h, width, height)


def render(heat: Heat, title: list[str]) -> tuple[bytes, Layout, list[RGB], float]:
    """The PNG, its layout, the palette and the value at the top of the scale."""
    layers, heads, _, tokens = heat.values.shape
    finite = heat.values[torch.isfinite(heat.values)]
    top = float(finite.max()) if finite.numel() else 1.0
    tol = heat.tolerance if heat.tolerance is not None and heat.tolerance > 0 else None
    vmax = max(top, tol or 0.0, 1e-30)
    colours = palette(tol / vmax if tol else 1.0)
    lay = layout(layers, heads, tokens, title)
    if lay.width * lay.height > MAX_PLOT_PIXELS:
        raise NothingToPlot(f"too large to plot: {layers} layers x {heads} heads x {tokens} "
                            f"tokens makes a {lay.width}x{lay.height} picture, over "
                            f"{MAX_PLOT_PIXELS} pixels")
    c = Canvas(lay.width, lay.height, BACKGROUND)
    for i, line in enumerate(title):
        c.text(12, 12 + i * 14, line)
    for h in range(heads):
        x, _ = lay.cell_origin(0, h, 0, 0)
        c.text(x, lay.grid_y - 14, f"H{h}")
    scaled = (heat.values.clamp(max=vmax) / vmax * (LEVELS - 1)).nan_to_num(LEVELS - 1)
    levels: list[list[list[list[int]]]] = scaled.round().to(torch.int64).tolist()
    for layer in range(layers):
        _, y = lay.cell_origin(layer, 0, 0, 0)
        scale = 2 if lay.cell_h >= 10 else 1
        c.text(12, y, f"L{layer} K" if lay.cell_h >= 5 else f"L{layer}", scale=scale)
        if lay.cell_h >= 5:
            c.text(12 + text_width(f"L{layer} ", scale), y + lay.cell_h, "V", scale=scale)
        for head in range(heads):
            for kv in (0, 1):
                row = levels[layer][head][kv]
                for token in range(tokens):
                    x, y = lay.cell_origin(layer, head, kv, token)
                    c.rect(x, y, lay.cell_w, lay.cell_h, colours[row[token]])
            # block boundaries inside a tile: a thin white line
            for k in range(1, len(heat.blocks)):
                x, y = lay.cell_origin(layer, head, 0, k * heat.block_tokens)
                c.rect(x, y, 1, lay.tile_h, BACKGROUND)
    _colour_bar(c, lay, colours, vmax, tol)
    return c.png(), lay, colours, vmax


def _colour_bar(c: Canvas, lay: Layout, colours: list[RGB], vmax: float,
                tol: float | None) -> None:
    """The scale, top = ``vmax``; the tolerance marked with a black line and its value."""
    for i in range(lay.bar_h):
        level = round((lay.bar_h - 1 - i) / max(lay.bar_h - 1, 1) * (LEVELS - 1))
        c.rect(lay.bar_x, lay.bar_y + i, 14, 1, colours[level])
    c.text(lay.bar_x + 18, lay.bar_y, f"{vmax:.3g}".upper(), scale=1)
    c.text(lay.bar_x + 18, lay.bar_y + lay.bar_h - 5, "0", scale=1)
    if tol is not None:
        y = lay.bar_y + round((1 - tol / vmax) * (lay.bar_h - 1))
        c.rect(lay.bar_x - 4, y, 22, 2, (0, 0, 0))
        c.text(lay.bar_x + 18, min(max(y - 2, lay.bar_y + 8), lay.bar_y + lay.bar_h - 14),
               f"TOL {tol:.3g}".upper(), scale=1)
