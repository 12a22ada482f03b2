"""A fleet on 127.0.0.1: N kv-sidecar demo replicas (one with a fault) behind one Prometheus
and one Alertmanager, and a webhook "pager" that prints every notification.

    .venv/bin/python examples/fleet/fleet.py --replicas 4 --fault zero-block   # Ctrl-C stops
    make fleet N=4 FAULT=zero-block

Each replica is scraped as its own target with the fleet label conventions
(examples/fleet/README.md): ``instance`` (the target), ``replica`` and ``gpu`` (target
labels), so the page names the bad replica and its GPU. Prometheus evaluates the shipped
rules and Alertmanager routes with the shipped config, exactly as examples/stack/stack.py
runs them; this script reuses that script's machinery (processes stopped by PID, configs
rewritten into a temporary directory). The end-to-end test tests/e2e/test_fleet.py drives
the same functions.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
STACK_PY = HERE.parent / "stack" / "stack.py"
STACK_MODULE = "kvsidecar_example_stack"


def _load_stack() -> ModuleType:
    """examples/stack/stack.py as a module (examples are scripts, not a package)."""
    if STACK_MODULE in sys.modules:
        return sys.modules[STACK_MODULE]
    spec = importlib.util.spec_from_file_location(STACK_MODULE, STACK_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[STACK_MODULE] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


stack = _load_stack()
HOST: str = stack.HOST


@dataclass(frozen=True)
class Replica:
    """One demo replica: its scrape target and the target labels that name it."""

    index: int
    port: int
    fault: str

    @property
    def name(self) -> str:
        return f"replica-{self.index}"

    @property
    def gpu(self) -> str:
        return f"gpu-{self.index}"

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"


def plan(n: int, fault: str, faulty: int, ports: Sequence[int]) -> list[Replica]:
    """``n`` replicas on ``ports``; replica ``faulty`` runs ``fault``, the others none."""
    if n < 1 or len(ports) != n:
        raise ValueError(f"need {n} >= 1 ports, got {len(ports)}")
    if not 0 <= faulty < n:
        raise ValueError(f"faulty replica {faulty} is not one of 0..{n - 1}")
    return [Replica(i, ports[i], fault if i == faulty else "none") for i in range(n)]


def prometheus_config(replicas: Sequence[Replica], alertmanager: str,
                      interval: str) -> dict[str, Any]:
    """The stack's Prometheus config with one static target per replica, each carrying the
    ``replica`` and ``gpu`` target labels (alerts.rules.MixinConfig.target_labels)."""
    cfg: dict[str, Any] = stack.prometheus_config([r.target for r in replicas], alertmanager,
                                                  interval)
    cfg["scrape_configs"][0]["static_configs"] = [
        {"targets": [r.target], "labels": {"replica": r.name, "gpu": r.gpu}}
        for r in replicas]
    return cfg


def replica_process(workdir: Path, r: Replica, hold_s: float, pace_s: float,
                    requests: int) -> Any:
    """The demo for one replica; each replica gets its own workload seed."""
    proc = stack.demo_process(workdir, r.name, r.port, r.fault, hold_s, pace_s, requests)
    proc.argv += ["--seed", str(r.index), "--quiet"]
    return proc


def start_replicas(workdir: Path, replicas: Sequence[Replica], procs: list[Any],
                   hold_s: float, pace_s: float, requests: int,
                   timeout_s: float = 90.0) -> None:
    """Start every replica, then wait until all serve /healthz, so Prometheus sees the
    whole fleet from its first scrape (a fleet counted short would not localise)."""
    started = []
    for r in replicas:
        proc = replica_process(workdir, r, hold_s, pace_s, requests).start()
        procs.append(proc)
        started.append((r, proc))
    for r, proc in started:
        stack.wait_http(f"http://{r.target}/healthz", timeout_s, proc)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="N kv-sidecar demo replicas behind one "
                                             "Prometheus and Alertmanager on 127.0.0.1")
    ap.add_argument("--replicas", type=int, default=4, help="number of replicas (default 4)")
    ap.add_argument("--fault", default="zero-block", help="fault of the faulty replica")
    ap.add_argument("--faulty", type=int, default=1, help="index of the faulty replica")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--pace", type=float, default=0.05, help="seconds between requests")
    ap.add_argument("--hold", type=float, default=3600, help="serve metrics this long after")
    ap.add_argument("--interval", default="5s", help="scrape and rule evaluation interval")
    ap.add_argument("--prometheus-port", type=int, default=19090)
    ap.add_argument("--alertmanager-port", type=int, default=19093)
    ap.add_argument("--webhook-port", type=int, default=19096)
    ap.add_argument("--first-replica-port", type=int, default=19470,
                    help="replica i listens on this port + i")
    args = ap.parse_args(argv)
    try:
        replicas = plan(args.replicas, args.fault, args.faulty,
                        [args.first_replica_port + i for i in range(args.replicas)])
    except ValueError as e:
        print(f"fleet: {e}", file=sys.stderr)
        return 2
    prom_bin = stack.find_binary("prometheus")
    am_bin = stack.find_binary("prometheus-alertmanager", "alertmanager")
    if not prom_bin or not am_bin:
        print("needs prometheus and alertmanager on PATH "
              "(Debian: apt-get install prometheus prometheus-alertmanager)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kv-sidecar-fleet-"))
    pager = stack.WebhookReceiver(args.webhook_port, echo=True)
    am_addr = f"{HOST}:{args.alertmanager_port}"
    procs: list[Any] = []
    signal.signal(signal.SIGTERM, stack._interrupt)  # SIGTERM stops the fleet like Ctrl-C
    try:
        with stack.stopping(procs):
            am = stack.alertmanager_process(workdir, am_bin, args.alertmanager_port,
                                            stack.alertmanager_config(pager.url, "10s", "1m"))
            procs.append(am.start())
            stack.wait_http(f"http://{am_addr}/-/ready", 30, am)
            start_replicas(workdir, replicas, procs, args.hold, args.pace, args.requests)
            prom = stack.prometheus_process(workdir, prom_bin, args.prometheus_port,
                                            prometheus_config(replicas, am_addr,
                                                              args.interval))
            procs.append(prom.start())
            wait = f"http://{HOST}:{args.prometheus_port}/-/ready"
            stack.wait_http(wait, 60, prom)
            for r in replicas:
                print(f"{r.name} ({r.gpu})  http://{r.target}/metrics  fault={r.fault}")
            print(f"prometheus    http://{HOST}:{args.prometheus_port}/alerts\n"
                  f"alertmanager  http://{am_addr}/#/alerts\n"
                  f"pager webhook {pager.url} (notifications print below)\n"
                  f"logs          {workdir}\nCtrl-C to stop.", flush=True)
            while any(p.running() for p in procs[1:1 + len(replicas)]):
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        pager.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print("fleet stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
