"""Regenerate the generated parts of README.md (``python -m kvtestbed.docs``)."""

from __future__ import annotations

import sys
from pathlib import Path

from sidecar import signals

START, END = "<!-- signals-table:start -->", "<!-- signals-table:end -->"


def render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{signals.markdown_table()}\n{END}{tail}"


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("README.md")
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
