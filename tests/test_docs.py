"""The docs take signal names from the single source of truth."""

from pathlib import Path

from sidecar import signals

ROOT = Path(__file__).resolve().parent.parent


def test_readme_signals_table_matches_signals_module():
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- signals-table:start -->") + len("<!-- signals-table:start -->")
    end = text.index("<!-- signals-table:end -->")
    assert text[start:end].strip() == signals.markdown_table().strip(), (
        "README signals table is stale: run `kv-sidecar signals --markdown` and paste it "
        "between the signals-table markers (or `python -m kvtestbed.docs`)")
