"""Where a block is wrong, as a figure: ``kv-sidecar evidence show ID --plot out.png``.

The recompute check condemns a block on ``max|cached - recomputed| / rms(recomputed)``
(:mod:`sidecar.checks.recompute`, per block, K and V apart). The figure shows that same
quantity before the max, as one image: a row per layer and K/V (y axis: layer), a column per
KV head and token (x axis: token, grouped by head), each cell the largest over ``head_dim``.
The colour bar marks the tolerance: cells below it are blues, cells above it run red to
yellow, so the wrong positions stand out at a glance. The title names the record, the kind
(the checks that fired), the cache group and the blocks.

Drawn with matplotlib (the ``[plot]`` extra), on its object API with the Agg canvas: no
pyplot state, no display, nothing global touched in the process that draws.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

LEVELS = 256  # colours in the scale: half blues (under the tolerance), half red to yellow
DPI = 100
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
                if 0 in shape:
                    raise NothingToPlot(f"block {b} {side} {part} has shape {shape}: empty")
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


def colormap() -> Any:
    """The scale's colours: ``LEVELS // 2`` blues from light to deep for 0 up to the
    tolerance, then red through yellow above it (``TwoSlopeNorm`` centres it on the
    tolerance)."""
    from matplotlib.colors import ListedColormap

    half = LEVELS // 2
    blues = [(0.92 - 0.72 * u, 0.94 - 0.55 * u, 0.98 - 0.24 * u)
             for u in (i / (half - 1) for i in range(half))]
    hot = [(0.78 + 0.22 * u, 0.08 + 0.86 * u, 0.08 + 0.4 * u * u)
           for u in (i / (half - 1) for i in range(half))]
    return ListedColormap(blues + hot, name="kvsidecar-tolerance")


def _norm(vmax: float, tol: float | None) -> Any:
    from matplotlib.colors import Normalize, TwoSlopeNorm

    if tol is None or not 0 < tol < vmax:
        return Normalize(vmin=0.0, vmax=vmax)
    return TwoSlopeNorm(vmin=0.0, vcenter=tol, vmax=vmax)


def _ticks(count: int, most: int) -> list[int]:
    step = max(1, -(-count // most))
    return list(range(0, count, step))


def render(heat: Heat, title: str, subtitle: str = "") -> tuple[bytes, dict[str, Any], float]:
    """The PNG, where the image sits in it (for a reader: pixel box of the grid, rows and
    columns) and the value at the top of the scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers, heads, _, tokens = heat.values.shape
    finite = heat.values[torch.isfinite(heat.values)]
    top = float(finite.max()) if finite.numel() else 1.0
    tol = heat.tolerance if heat.tolerance is not None and heat.tolerance > 0 else None
    # never past the values' own range: a tolerance of 1e308 would overflow the clamp
    vmax = min(max(top, tol * 1.25 if tol else 0.0, 1e-30), torch.finfo(heat.values.dtype).max)
    rows, cols = 2 * layers, heads * tokens
    width_in = min(max(3.0 + cols * 0.14, 6.0), 40.0)
    height_in = min(max(2.2 + rows * 0.22, 3.5), 40.0)
    if width_in * height_in * DPI * DPI > MAX_PLOT_PIXELS:
        raise NothingToPlot(f"too large to plot: {layers} layers x {heads} heads x {tokens} "
                            f"tokens, over {MAX_PLOT_PIXELS} pixels")
    image = heat.values.clamp(max=vmax).nan_to_num(nan=vmax, posinf=vmax)
    # (layers, heads, 2, tokens) -> rows: layer-major K, V; columns: head-major tokens
    grid = image.permute(0, 2, 1, 3).reshape(rows, cols).numpy()
    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    shown = ax.imshow(grid, cmap=colormap(), norm=_norm(vmax, tol), aspect="auto",
                      interpolation="nearest", resample=False)
    fig.suptitle(f"{title}\n{subtitle}" if subtitle else title, fontsize=9)
    ax.set_ylabel("layer (rows K, V)")
    ax.set_xlabel(f"token (within each of {heads} KV head{'s' if heads > 1 else ''})")
    row_ticks = _ticks(rows, 32)
    ax.set_yticks(row_ticks, [f"L{r // 2} {'KV'[r % 2]}" for r in row_ticks], fontsize=7)
    col_ticks = [h * tokens + t for h in range(heads) for t in _ticks(tokens, max(2, 48 // heads))]
    ax.set_xticks(col_ticks, [str(c % tokens) for c in col_ticks], fontsize=6)
    heads_axis = ax.secondary_xaxis("top")
    head_ticks = _ticks(heads, 24)
    heads_axis.set_xticks([h * tokens + (tokens - 1) / 2 for h in head_ticks],
                          [f"head {h}" for h in head_ticks], fontsize=7)
    for h in range(1, heads):  # head boundaries: cell edges, never a cell's centre
        ax.axvline(h * tokens - 0.5, color="black", linewidth=1.5)
    for k in range(1, len(heat.blocks)):  # block boundaries inside a head
        for h in range(heads):
            ax.axvline(h * tokens + k * heat.block_tokens - 0.5, color="black", linewidth=0.6,
                       linestyle=":")
    for r in range(2, rows, 2):  # layer boundaries
        ax.axhline(r - 0.5, color="white", linewidth=1.0)
    bar = fig.colorbar(shown, ax=ax, fraction=0.04, pad=0.02)
    bar.set_label("|cached - recomputed| / rms(recomputed)", fontsize=7)
    if tol is not None:
        bar.ax.axhline(tol, color="black", linewidth=2)
        bar.set_ticks([0.0, tol, vmax], labels=["0", f"tolerance {tol:.3g}", f"{vmax:.3g}"])
    fig.canvas.draw()
    box = ax.get_window_extent()  # display pixels, origin bottom left
    height_px = round(fig.get_figheight() * DPI)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    layout = {"layers": layers, "heads": heads, "tokens": tokens, "rows": rows, "cols": cols,
              "width": round(fig.get_figwidth() * DPI), "height": height_px,
              "x0": box.x0, "x1": box.x1, "top": height_px - box.y1,
              "bottom": height_px - box.y0}
    return buf.getvalue(), layout, vmax


def cell_centre(layout: Mapping[str, Any], layer: int, head: int, kv: int,
                token: int) -> tuple[int, int]:
    """Pixel (x, y from the top) of a cell's centre in the PNG :func:`render` wrote."""
    col = head * layout["tokens"] + token
    row = 2 * layer + kv
    x = layout["x0"] + (col + 0.5) * (layout["x1"] - layout["x0"]) / layout["cols"]
    y = layout["top"] + (row + 0.5) * (layout["bottom"] - layout["top"]) / layout["rows"]
    return int(x), int(y)
