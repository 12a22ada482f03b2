"""``bench perf --engine vllm|sglang`` drives one configuration at a time with the others
stopped (kvtestbed.bench.perf_servers.alone): an idle engine on a small machine still takes
CPU (spinning OpenMP workers, a polling scheduler), which made the configurations of one
run measure 15-20% apart. Here two stand-in "servers" (process groups of sleeping
children): while one runs alone, every process of the other is stopped, and all run again
after, also when the driven code raises."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from kvtestbed.bench.perf_servers import Server, alone, stop


def _state(pid: int) -> str:
    """The process's state letter in /proc (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _server(name: str, tmp_path: Path) -> Server:
    tmp_path.mkdir(parents=True)
    srv = Server(name, None, "http://127.0.0.1:1", tmp_path)
    for role in ("engine", "sidecar"):
        srv.spawn(f"{name}-{role}", [sys.executable, "-c", "import time; time.sleep(120)"],
                  {})
    return srv


def _wait_state(pid: int, want: set[str]) -> str:
    deadline = time.monotonic() + 30
    while (s := _state(pid)) not in want and time.monotonic() < deadline:
        time.sleep(0.01)
    return s


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_the_others_are_stopped_while_one_runs_and_continue_after(tmp_path: Path) -> None:
    a, b = _server("a", tmp_path / "a"), _server("b", tmp_path / "b")
    try:
        with alone(a, [a, b]):
            assert {_wait_state(p.pid, {"T"}) for p in b.procs} == {"T"}
            assert all(_state(p.pid) != "T" for p in a.procs)
        assert all(_wait_state(p.pid, {"S", "R"}) in {"S", "R"} for p in b.procs)
        with pytest.raises(RuntimeError), alone(b, [a, b]):
            raise RuntimeError("a run failed")
        assert all(_wait_state(p.pid, {"S", "R"}) in {"S", "R"} for p in a.procs)
    finally:
        stop([a, b])
    assert all(p.poll() is not None for p in a.procs + b.procs)


def test_a_server_that_already_exited_is_left_alone(tmp_path: Path) -> None:
    a, b = _server("a", tmp_path / "a"), _server("b", tmp_path / "b")
    try:
        b.procs[0].kill()
        b.procs[0].wait(10)
        with alone(a, [a, b]):  # no error for the dead one; the live one stopped
            assert _wait_state(b.procs[1].pid, {"T"}) == "T"
    finally:
        stop([a, b])
    assert all(p.poll() is not None for p in a.procs + b.procs)
