"""Argument types and the usage error shared by the core CLI and the testbed's commands
(:mod:`kvtestbed.commands`), kept apart from :mod:`sidecar.cli.main` so the testbed can use
them without importing the CLI that imports it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """Bad user input: printed without a traceback, exit code 2."""


def bounded(kind: type, low: float, high: float | None = None) -> Callable[[str], Any]:
    """An argparse type: parse ``kind`` and check ``low <= value (<= high)``, with a message
    that says what was expected (argparse turns it into exit code 2)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole number' if kind is int else 'number'}, got {text!r}"
            ) from None
        if value != value or value < low or (high is not None and value > high):  # NaN too
            bound = f"{low:g}..{high:g}" if high is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = bounded(int, 1)
nonneg_float = bounded(float, 0.0)
port = bounded(int, 0, 65535)

DTYPES = ("float32", "bfloat16", "float16")


MAX_DEVICE_INDEX = 127  # torch's device index is 8 bits: "cuda:999" parses as cuda:-25


def device_name(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``, spelt as torch parses it (no
    leading zero, N <= 127), checked by spelling only, so ``config check`` refuses ``tpu``,
    ``cuda:-1`` or ``cuda:01`` on any machine; whether the device exists is checked where it
    is used (a config may be checked off the GPU box)."""
    kind, sep, index = text.partition(":")
    canonical = index.isascii() and index.isdigit() and str(int(index)) == index
    if text == "cpu" or (kind == "cuda" and (not sep or (
            canonical and int(index) <= MAX_DEVICE_INDEX))):
        return text
    raise argparse.ArgumentTypeError(
        f"expected cpu, cuda or cuda:N (N = 0..{MAX_DEVICE_INDEX}, no leading zero), got {text!r}")


def started(service: Any, prog: str) -> bool:
    """Start a serve command's sidecar (``service.start()``); where it cannot start (its
    socket could not be bound: ``RuntimeError``), stop what did and say why in one line on
    stderr instead of a traceback. False then: the command exits 1."""
    try:
        service.start()
    except RuntimeError as exc:
        service.stop()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return False
    return True


def listening(make: Callable[[], T], service: Any, prog: str) -> T | None:
    """Open a serve command's HTTP endpoint (``make()``); where its address cannot be bound
    (a port in use, a host that is not this machine's: ``OSError``, said with the address),
    stop the already started ``service`` (its socket files removed) and say why in one line
    on stderr instead of a traceback. None then: the command exits 1."""
    try:
        return make()
    except OSError as exc:
        service.stop()
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return None
