"""Issue 21: the CLI on a stdout whose reader went away (``kv-sidecar signals | head -1``,
``... | true``) exits 141 quietly, as a shell reports a command killed by SIGPIPE: no
traceback, no "Exception ignored" from the interpreter's last flush (75d8333: exit 1 with
"error: [Errno 32] Broken pipe", or 120 and a traceback). Real pipes, real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sidecar.cli.main import EXIT_BROKEN_PIPE


def _run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose read end is closed before it starts: every
    write fails, whatever the timing (a `| head -1` reader may close it before or after)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "sidecar.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("args", [("signals",), ("signals", "--markdown"), ("faults",),
                                  ("config", "show")])
def test_closed_stdout_exits_141_quietly(args: tuple[str, ...]) -> None:
    proc = _run_into_closed_pipe(*args)
    assert proc.returncode == EXIT_BROKEN_PIPE == 141, proc.stderr
    assert proc.stderr == ""


def test_a_reader_that_stops_after_one_line() -> None:
    """`| head -1` as the shell builds it: the reader takes one line and closes."""
    cmd = [sys.executable, "-m", "sidecar.cli", "signals"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
    assert first.startswith(b"kvsidecar_")
    assert code in (0, EXIT_BROKEN_PIPE)  # 0: it wrote everything before the reader closed
    assert err == b""


def test_an_open_stdout_still_exits_0() -> None:
    proc = subprocess.run([sys.executable, "-m", "sidecar.cli", "signals"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("\n") > 10 and proc.stderr == ""
