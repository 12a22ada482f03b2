"""examples/fleet/fleet.py: the replica plan, the scrape config with the fleet label
conventions and clear errors for a bad plan (unit stage, nothing started), and the script
itself starting and stopping a small fleet (e2e, real binaries)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from alerts.rules import MixinConfig
from tests.e2e import live
from tests.e2e.test_fleet import REPO, fleet_mod, stack_mod
from tests.promtools import require


def test_one_faulty_replica_the_others_clean() -> None:
    replicas = fleet_mod.plan(4, "zero-block", 1, [9001, 9002, 9003, 9004])
    assert [r.fault for r in replicas] == ["none", "zero-block", "none", "none"]
    assert [r.target for r in replicas] == [f"127.0.0.1:{p}" for p in (9001, 9002, 9003, 9004)]


@pytest.mark.parametrize(("n", "faulty", "ports", "message"), [
    (0, 0, [], "need 0 >= 1 ports"),
    (2, 0, [9001], "need 2 >= 1 ports, got 1"),
    (2, 2, [9001, 9002], "faulty replica 2 is not one of 0..1"),
])
def test_a_bad_plan_is_a_clear_error(n: int, faulty: int, ports: list[int],
                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fleet_mod.plan(n, "zero-block", faulty, ports)


def test_cli_rejects_a_bad_plan_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_mod.main(["--replicas", "3", "--faulty", "5"]) == 2
    assert "faulty replica 5 is not one of 0..2" in capsys.readouterr().err


def test_each_replica_is_a_target_with_the_labels_the_fleet_page_copies() -> None:
    replicas = fleet_mod.plan(3, "zero-block", 2, [9001, 9002, 9003])
    cfg = fleet_mod.prometheus_config(replicas, "127.0.0.1:9093", "1s")
    job = cfg["scrape_configs"][0]
    assert job["job_name"] == "kv-sidecar"
    assert job["static_configs"] == [
        {"targets": [f"127.0.0.1:{9001 + i}"],
         "labels": {"replica": f"replica-{i}", "gpu": f"gpu-{i}"}} for i in range(3)]
    labels = {k for c in job["static_configs"] for k in c["labels"]}
    assert labels == set(MixinConfig().target_labels)
    assert cfg["global"]["scrape_interval"] == "1s"


def test_each_replica_runs_its_own_seed_and_fault(tmp_path: Path) -> None:
    r = fleet_mod.plan(2, "nonfinite", 1, [9001, 9002])[1]
    argv = fleet_mod.replica_process(tmp_path, r, 10, 0.1, 20).argv
    assert argv[argv.index("--fault") + 1] == "nonfinite"
    assert argv[argv.index("--seed") + 1] == "1"
    assert argv[argv.index("--port") + 1] == "9002"


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.e2e
def test_fleet_script_starts_and_stops_cleanly() -> None:
    """`make fleet`'s script: three replicas, Prometheus, Alertmanager and the pager up on
    our ports, then Ctrl-C stops every process it started and removes its directory."""
    require("prometheus")
    require("prometheus-alertmanager", "alertmanager")
    ports = {flag: stack_mod.free_port() for flag in ("prometheus", "alertmanager", "webhook")}
    first = stack_mod.free_port()
    replica_ports = [first + i for i in range(3)]
    if any(_listening(p) for p in replica_ports):
        pytest.skip(f"ports {replica_ports} are busy")
    argv = [sys.executable, str(REPO / "examples" / "fleet" / "fleet.py"), "--replicas", "3",
            "--fault", "none", "--requests", "10", "--hold", "120", "--interval", "1s",
            "--first-replica-port", str(first)]
    argv += [a for flag, port in ports.items() for a in (f"--{flag}-port", str(port))]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)
    lines: list[str] = []
    out = proc.stdout
    assert out is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True)
    reader.start()
    try:
        live.wait_for("the fleet's ready message", 120,
                      lambda: any("Ctrl-C to stop" in line for line in lines)
                      or proc.poll() is not None)
        assert proc.poll() is None, "".join(lines)
        assert all(_listening(p) for p in [*ports.values(), *replica_ports])
        assert sum(line.startswith("replica-") for line in lines) == 3, "".join(lines)
        workdir = next(line.split()[-1] for line in lines if line.startswith("logs"))
        assert Path(workdir).is_dir()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=180) == 0, "".join(lines)  # bounds a hang: each child gets 10 s
    finally:
        if proc.poll() is None:  # a failed check: let the script stop its children first
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    reader.join(timeout=5)
    assert "fleet stopped" in "".join(lines)
    assert not [p for p in [*ports.values(), *replica_ports] if _listening(p)], \
        "a child survived the stop"
    assert not Path(workdir).exists()
