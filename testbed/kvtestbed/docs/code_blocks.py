"""The code blocks of the site's pages and the marker each one carries (for the tests).

Every ``sh``/``bash``/``python`` block says, on the line right above it, what is done with it:

* ``<!-- docs-test: run -->``: a test runs it; for shell, each line is a command and exits 0
  unless a trailing comment says ``# exit N``;
* ``<!-- docs-test: run-by PATH -->``: the test or script at ``PATH`` runs it (or what it shows);
* ``<!-- docs-test: skip REASON -->``: not runnable here, and why.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHECKED_LANGUAGES = ("sh", "bash", "python")
MARKER = re.compile(r"^<!-- docs-test: (run|run-by|skip)(?: (.*?))? -->$")
FENCE = re.compile(r"^```([\w-]*)\s*$")
EXIT = re.compile(r"#.*?\bexit (\d+)")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its marker (``None``: unmarked)."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: str | None  # run, run-by, skip
    argument: str  # run-by's path, skip's reason

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def pages(root: Path) -> list[Path]:
    """Every Markdown page a reader meets: the site, the README, the examples' READMEs."""
    found = sorted((root / "docs").rglob("*.md"))
    return [root / "README.md", *found, *sorted((root / "examples").glob("*/README.md"))]


def blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, language = i, m.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        above = lines[start - 1].strip() if start > 0 else ""
        marker = MARKER.match(above)
        yield Block(path, start + 1, language, "\n".join(lines[start + 1:j]) + "\n",
                    marker.group(1) if marker else None,
                    (marker.group(2) or "") if marker else "")
        i = j + 1


def commands(block: Block) -> Iterator[tuple[str, int]]:
    """A runnable shell block's commands, each with the exit code its comment states."""
    for line in block.code.splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        m = EXIT.search(text)
        yield text, int(m.group(1)) if m else 0
