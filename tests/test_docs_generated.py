"""The site's generated pages are what the code and the recorded runs say now (as the
dashboards' JSON is checked): a stale one fails with the command that fixes it."""

from __future__ import annotations

from pathlib import Path

from kvtestbed.docs.page_list import orphans, outputs

ROOT = Path(__file__).resolve().parent.parent


def test_every_generated_page_is_fresh() -> None:
    stale = [o.path for o in outputs(ROOT) if o.is_stale(ROOT)] + orphans(ROOT)
    assert stale == [], "stale: run `python -m kvtestbed.docs` and commit the result"


def test_a_changed_region_is_seen_as_stale(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text("prose\n<!-- generated:x:start -->\nold\n<!-- generated:x:end -->\nmore\n")
    from kvtestbed.docs.regions import Output

    out = Output("docs/p.md", lambda: "new", region="x")
    assert out.is_stale(tmp_path)
    assert out.write(tmp_path) and not out.is_stale(tmp_path)
    assert page.read_text() == ("prose\n<!-- generated:x:start -->\nnew\n"
                                "<!-- generated:x:end -->\nmore\n")


def test_every_runbook_has_its_copy_in_the_site_and_the_alert_table_links_it() -> None:
    table = (ROOT / "docs/operations/dashboards-and-alerts.md").read_text()
    for book in sorted((ROOT / "alerts/runbooks").glob("*.md")):
        copy = ROOT / "docs/operations/runbooks" / book.name
        assert copy.read_text().endswith(book.read_text()), book.name
        assert f"(runbooks/{book.name})" in table, book.name


def test_the_site_lists_every_signal_and_config_key_of_the_code() -> None:
    from sidecar import signals
    from sidecar.config.schema import build_schema

    page = (ROOT / "docs/reference/signals.md").read_text()
    assert all(f"`{s.name}`" in page for s in signals.ALL_SIGNALS)
    config = (ROOT / "docs/reference/config.md").read_text()
    for keys in build_schema().sections.values():
        assert all(f"`{k.env}`" in config for k in keys.values())


def test_a_recordings_load_average_is_labelled_when_it_was_taken() -> None:
    """The recorder took the host's load after the run and labelled it "at start" (a
    recording made at load 0.7 said 5.7): now taken first; older recordings keep theirs
    under ``load_at_end`` and say so."""
    from kvtestbed.docs.bench_tables import provenance

    doc = {"bench": "x", "machine": {"cpu": "x", "cores": 2, "system": "s", "python": "3",
                                     "torch": "2", "load_at_start": 0.7},
           "exit_code": 0, "scope": "full: x", "command": "kv-sidecar bench x", "date": "d",
           "commit": "c", "seconds": 1}
    assert "load average 0.7 at start" in provenance(doc)
    doc["machine"] = {**doc["machine"], "load_at_end": 5.7}
    del doc["machine"]["load_at_start"]
    assert "load average 5.7 at the end" in provenance(doc)
