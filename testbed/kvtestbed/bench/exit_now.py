"""Leave a bench process once its report is printed, without the interpreter's teardown."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Printed and flushed: exit without the interpreter's teardown. The in-process benches
    leave threads behind (adapter calls abandoned past their limit, hostile peers'
    handlers, verifier and poller threads of the monitors they measured), and about one run
    in 20-40 aborted after printing its report ("terminate called without an active
    exception", SIGABRT: `bench reliability` at stop 42, `bench perf --quick` in a CI run
    since): the usual cause, a daemon thread ended by the finalizing interpreter inside a
    C++ (torch) frame. Not attributed to one thread."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
