"""Every name a page cites exists in the code: ``kvsidecar_*`` metrics, ``kv-sidecar ...
--flag`` flags, ``KVSIDECAR_*`` environment variables and configuration keys. A page that
cites a removed flag, metric or key fails here, naming the page."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from kvtestbed.docs.cli_help import _parsers
from kvtestbed.docs.code_blocks import pages

ROOT = Path(__file__).resolve().parent.parent
METRIC = re.compile(r"(?<![\w:])kvsidecar_[a-z0-9_]+")
ENV = re.compile(r"\bKVSIDECAR_[A-Z0-9_]+\b(?!<)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
SERIES_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
SECTIONS = ("sidecar", "demo", "vllm", "canary", "guard")
FILE_TYPES = {"sh", "md", "py", "toml", "json", "yml", "yaml", "png", "txt"}


def _texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in pages(ROOT)
            if "operations/runbooks" not in str(p)]  # copies: alerts/tests cover their source


@cache
def _metric_names() -> frozenset[str]:
    from sidecar import signals

    names = {s.name for s in signals.ALL_SIGNALS}
    return frozenset(names | {n + sfx for n in names for sfx in SERIES_SUFFIXES}
                     | {n.removesuffix("_total") for n in names})


def _code_literals(prefix: str) -> set[str]:
    """Every ``PREFIX...`` string the code spells out (environment names the CLI reads)."""
    found: set[str] = set()
    for folder in ("sidecar", "testbed/kvtestbed"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(rf"\b{prefix}[A-Z0-9_]+\b", path.read_text()))
    return found


def test_every_cited_metric_is_a_signal() -> None:
    known = _metric_names()
    unknown = {(page, m) for page, text in _texts() for m in METRIC.findall(text)
               if m not in known and not m.endswith("_")}
    assert unknown == set()


def test_every_cited_environment_variable_is_read_by_the_code() -> None:
    from sidecar.config.schema import build_schema

    known = {k.env for keys in build_schema().sections.values() for k in keys.values()}
    known |= _code_literals("KVSIDECAR_")
    unknown = {(page, e) for page, text in _texts() for e in ENV.findall(text)
               if e not in known and not e.endswith("_")}
    assert unknown == set()


@cache
def _flags() -> dict[tuple[str, ...], frozenset[str]]:
    out: dict[tuple[str, ...], set[str]] = {}
    for path, parser in _parsers():
        out.setdefault(path, set()).update(
            opt for action in parser._actions for opt in action.option_strings)
    return {k: frozenset(v) for k, v in out.items()}


def _command_lines(text: str) -> list[str]:
    spans = [s for s in CODE_SPAN.findall(text) if s.startswith("kv-sidecar ")]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("kv-sidecar ")]
    joined = re.sub(r"\\\n\s*", " ", text)  # continued shell lines
    lines += [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("kv-sidecar ")]
    return spans + lines


def _command_path(words: list[str]) -> tuple[str, ...]:
    flags = _flags()
    path: tuple[str, ...] = ()
    for word in words:
        if (*path, word) in flags:
            path = (*path, word)
        elif not word.startswith("-"):
            break
    return path


def test_every_cited_command_flag_exists_on_its_command() -> None:
    flags = _flags()
    unknown = set()
    for page, text in _texts():
        for line in _command_lines(text):
            words = line.split("#", 1)[0].replace("[", " ").replace("]", " ").split()[1:]
            path = _command_path(words)
            if not path:
                continue
            for word in words:
                flag = word.split("=", 1)[0].rstrip(",.;:)")
                if re.fullmatch(r"--[a-z][a-z0-9-]*", flag) and flag not in flags[path]:
                    unknown.add((page, " ".join(("kv-sidecar", *path)), flag))
    assert unknown == set()


def test_every_cited_configuration_key_exists() -> None:
    import dataclasses

    import sidecar
    from sidecar.config.schema import build_schema
    from sidecar.config.settings import SidecarConfig

    schema = build_schema().sections
    fields = {f.name for f in dataclasses.fields(SidecarConfig)}
    modules = {p.stem for p in Path(sidecar.__file__).parent.iterdir()}
    unknown = set()
    for page, text in _texts():
        for span in CODE_SPAN.findall(text):
            for section, key in re.findall(r"(?<![\w./-])([a-z]+)\.([a-z_]+)\b(?![.(/-])", span):
                if section not in SECTIONS or key in FILE_TYPES \
                        or (section == "sidecar" and key in modules):
                    continue
                if key not in schema.get(section, {}):
                    unknown.add((page, f"{section}.{key}"))
            for key in re.findall(r"\bSidecarConfig\.([a-z_]+)\b", span):
                if key not in fields:
                    unknown.add((page, f"SidecarConfig.{key}"))
    assert unknown == set()


def test_the_checks_see_a_removed_name() -> None:
    """The matchers above do find names: a page citing removed ones would fail."""
    text = "`kvsidecar_no_such_metric_total` `kv-sidecar demo --no-such-flag` `demo.nope`"
    assert "kvsidecar_no_such_metric_total" not in _metric_names()
    assert METRIC.findall(text) == ["kvsidecar_no_such_metric_total"]
    path = _command_path(["demo", "--no-such-flag"])
    assert path == ("demo",) and "--no-such-flag" not in _flags()[path]
    assert "--fault" in _flags()[path]


def test_every_cited_repository_path_exists() -> None:
    path_re = re.compile(r"(?<![\w/.-])((?:sidecar|testbed|tests|alerts|dashboards|deploy|"
                         r"examples|scripts)/[\w./-]*\w)")
    missing = {(page, p) for page, text in _texts() for span in CODE_SPAN.findall(text)
               for p in path_re.findall(span) if not (ROOT / p).exists()
               and "*" not in p and "<" not in p}
    assert missing == set()
