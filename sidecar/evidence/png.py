"""A tiny RGB canvas written as PNG with zlib and struct, and a 3x5 bitmap font for labels.

The evidence plot (:mod:`sidecar.evidence.plot`) is the only drawing the sidecar does, and
matplotlib is not a dependency of an operator's install: a PNG is a signature, an ``IHDR``
chunk, zlib-compressed scanlines (each prefixed by its filter byte, 0 here) in ``IDAT`` and
an ``IEND``, each chunk with its CRC-32 (RFC 2083).
"""

from __future__ import annotations

import struct
import zlib

RGB = tuple[int, int, int]
SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 3 columns x 5 rows per glyph, "#" = ink. Upper case only: labels are upper-cased.
_FONT_ROWS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"), "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"), "3": ("###", "..#", ".##", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"), "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "###"),
    "A": (".#.", "#.#", "###", "#.#", "#.#"), "B": ("##.", "#.#", "##.", "#.#", "##."),
    "C": (".##", "#..", "#..", "#..", ".##"), "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "E": ("###", "#..", "##.", "#..", "###"), "F": ("###", "#..", "##.", "#..", "#.."),
    "G": (".##", "#..", "#.#", "#.#", ".##"), "H": ("#.#", "#.#", "###", "#.#", "#.#"),
    "I": ("###", ".#.", ".#.", ".#.", "###"), "J": ("..#", "..#", "..#", "#.#", ".#."),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"), "L": ("#..", "#..", "#..", "#..", "###"),
    "M": ("#.#", "###", "###", "#.#", "#.#"), "N": ("##.", "#.#", "#.#", "#.#", "#.#"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."), "P": ("##.", "#.#", "##.", "#..", "#.."),
    "Q": (".#.", "#.#", "#.#", "##.", ".##"), "R": ("##.", "#.#", "##.", "#.#", "#.#"),
    "S": (".##", "#..", ".#.", "..#", "##."), "T": ("###", ".#.", ".#.", ".#.", ".#."),
    "U": ("#.#", "#.#", "#.#", "#.#", "###"), "V": ("#.#", "#.#", "#.#", "#.#", ".#."),
    "W": ("#.#", "#.#", "###", "###", "#.#"), "X": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "Y": ("#.#", "#.#", ".#.", ".#.", ".#."), "Z": ("###", "..#", ".#.", "#..", "###"),
    ".": ("...", "...", "...", "...", ".#."), "-": ("...", "...", "###", "...", "..."),
    "+": ("...", ".#.", "###", ".#.", "..."), ":": ("...", ".#.", "...", ".#.", "..."),
    "/": ("..#", "..#", ".#.", "#..", "#.."), "|": (".#.", ".#.", ".#.", ".#.", ".#."),
    "(": ("..#", ".#.", ".#.", ".#.", "..#"), ")": ("#..", ".#.", ".#.", ".#.", "#.."),
    "=": ("...", "###", "...", "###", "..."), "<": ("..#", ".#.", "#..", ".#.", "..#"),
    ">": ("#..", ".#.", "..#", ".#.", "#.."), "_": ("...", "...", "...", "...", "###"),
    "#": ("#.#", "###", "#.#", "###", "#.#"), ",": ("...", "...", "...", ".#.", "#.."),
    ";": ("...", ".#.", "...", ".#.", "#.."), " ": ("...", "...", "...", "...", "..."),
}
GLYPH_W, GLYPH_H = 3, 5


class Canvas:
    """An RGB image in memory: rectangles, text, PNG bytes."""

    def __init__(self, width: int, height: int, background: RGB = (255, 255, 255)) -> None:
        if width < 1 or height < 1:
            raise ValueError(f"canvas must be at least 1x1, got {width}x{height}")
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(background) * width) for _ in range(height)]

    def rect(self, x: int, y: int, w: int, h: int, colour: RGB) -> None:
        x0, y0 = max(0, x), max(0, y)
        x1, y1 = min(self.width, x + w), min(self.height, y + h)
        if x1 <= x0 or y1 <= y0:
            return
        run = bytes(colour) * (x1 - x0)
        for row in self.rows[y0:y1]:
            row[3 * x0:3 * x1] = run

    def text(self, x: int, y: int, text: str, scale: int = 2,
             colour: RGB = (0, 0, 0)) -> int:
        """Draw ``text`` with its top-left at (x, y); returns the x after it."""
        for ch in text.upper():
            glyph = _FONT_ROWS.get(ch, _FONT_ROWS["#"])
            for gy, line in enumerate(glyph):
                for gx, ink in enumerate(line):
                    if ink == "#":
                        self.rect(x + gx * scale, y + gy * scale, scale, scale, colour)
            x += (GLYPH_W + 1) * scale
        return x

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)  # filter 0 on every row
        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 6))
                + _chunk(b"IEND", b""))


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * (GLYPH_W + 1) * scale


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
