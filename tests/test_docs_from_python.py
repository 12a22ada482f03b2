"""The reference engine guide's "From Python" block runs as printed: a clean bfloat16 engine
with the sidecar attached at 1 in 1 serves 200 requests and reports no anomaly."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "reference-engine.md"


def _block() -> str:
    text = PAGE.read_text()
    marker = "<!-- docs-test: run-by tests/test_docs_from_python.py -->\n```python\n"
    start = text.index(marker) + len(marker)
    return text[start:text.index("```", start)]


def test_the_from_python_block_runs_and_a_clean_engine_is_quiet() -> None:
    code = _block()
    assert "engine.sink = monitor" in code  # the hook the page names
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(r"\{\}\n", out.stdout), out.stdout[-500:]  # no anomaly of any kind
