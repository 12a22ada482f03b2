"""The CLI reference page: every command's ``--help``, as argparse prints it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

HELP_WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the page does not depend on a terminal


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]
          ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if child.add_help:  # vllm and sglang hand over to parsers of their own
                    yield from _walk(child, (*path, name))


def _parsers() -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    from sidecar.adapters.sglang.cli import parser as sglang_parser
    from sidecar.adapters.vllm.cli import parser as vllm_parser
    from sidecar.cli.main import build_parser

    yield from _walk(build_parser(), ())
    yield from _walk(vllm_parser(), ("vllm",))
    yield from _walk(sglang_parser(), ("sglang",))


def commands() -> list[tuple[str, ...]]:
    """Every command path (``()`` is ``kv-sidecar`` itself), in page order."""
    return [path for path, _ in _parsers()]


def cli_page() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        out = ["# Command line", "",
               "Every `kv-sidecar` command's `--help`, as the installed code prints it "
               "(testbed installed, every extra). Exit codes: 0 success, 1 a run failed, "
               "2 bad usage or a missing extra (the message names it).", ""]
        for path, parser in _parsers():
            name = " ".join(("kv-sidecar", *path))
            out += [f"## `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(out)
