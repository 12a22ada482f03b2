"""A local monitoring stack on 127.0.0.1: the kv-sidecar demo, Prometheus, Alertmanager and a
webhook "pager" that prints every notification.

    .venv/bin/python examples/stack/stack.py --fault zero-block   # Ctrl-C stops everything

Prometheus evaluates the shipped rules (alerts/kv-sidecar.rules.yml) and Alertmanager routes
with the shipped example config (alerts/alertmanager.yml); both configs are read from the
repository and only their ports, intervals and paths are rewritten into a temporary
directory. Every process is started by this script and stopped by its PID. The end-to-end
test (tests/e2e/test_stack.py) drives the same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RULES = REPO / "alerts" / "kv-sidecar.rules.yml"
PROMETHEUS_YML = HERE / "prometheus.yml"
ALERTMANAGER_YML = REPO / "alerts" / "alertmanager.yml"
HOST = "127.0.0.1"


def find_binary(*names: str) -> str | None:
    """The first of ``names`` on PATH (Debian calls Alertmanager prometheus-alertmanager)."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def prometheus_config(targets: Sequence[str], alertmanager: str, interval: str) -> dict[str, Any]:
    """The example prometheus.yml with our targets, Alertmanager and intervals."""
    cfg = yaml.safe_load(PROMETHEUS_YML.read_text())
    cfg["global"]["scrape_interval"] = interval
    cfg["global"]["evaluation_interval"] = interval
    cfg["rule_files"] = [str(RULES)]
    cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [alertmanager]
    job = cfg["scrape_configs"][0]
    job["static_configs"] = [{"targets": list(targets)}]
    return dict(cfg)


def alertmanager_config(webhook_base: str, group_wait: str = "",
                        group_interval: str = "") -> dict[str, Any]:
    """alerts/alertmanager.yml with every webhook sent to ``webhook_base`` (same paths) and,
    for tests, shorter grouping delays. Routing and inhibition are left untouched."""
    cfg = yaml.safe_load(ALERTMANAGER_YML.read_text())
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            path = "/" + hook["url"].split("/", 3)[3]
            hook["url"] = webhook_base.rstrip("/") + path
    if group_wait or group_interval:
        for route in [cfg["route"], *cfg["route"].get("routes", [])]:
            if group_wait:
                route["group_wait"] = group_wait
            if group_interval:
                route["group_interval"] = group_interval
    return dict(cfg)


class WebhookReceiver:
    """Alertmanager's webhook target: records each notification as ``(path, payload)``."""

    def __init__(self, port: int = 0, echo: bool = False) -> None:
        self.notifications: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                payload = json.loads(self.rfile.read(length) or b"{}")
                with receiver._lock:
                    receiver.notifications.append((self.path, payload))
                if echo:
                    receiver.echo(self.path, payload)
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer((HOST, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://{HOST}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def alerts(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [a for p, n in self.notifications if p == path for a in n.get("alerts", [])]

    @staticmethod
    def echo(path: str, payload: dict[str, Any]) -> None:
        for a in payload.get("alerts", []):
            labels, notes = a.get("labels", {}), a.get("annotations", {})
            print(f"[{path.strip('/')}] {a.get('status', '?').upper()} "
                  f"{labels.get('alertname')} {labels.get('instance', '')}: "
                  f"{notes.get('summary', '')}", flush=True)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass
class Process:
    """A child process we started, logged to a file, stopped by its PID."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> Process:
        log = self.log_path.open("wb")
        self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self.env,
                                      cwd=str(REPO), start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM to our PID, SIGKILL if it does not exit in time."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=timeout_s)
        return self.popen.returncode

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def wait_http(url: str, timeout_s: float, proc: Process | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early (with the log) if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and not proc.running():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.log_tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    tail = proc.log_tail() if proc else ""
    raise TimeoutError(f"{url} not ready after {timeout_s:g}s\n{tail}")


def demo_process(workdir: Path, name: str, port: int, fault: str, hold_s: float,
                 pace_s: float = 0.0, requests: int = 400,
                 python: str = sys.executable, calibrate: int = 64) -> Process:
    """``calibrate``: the demo's sidecar learns its tolerance from that many clean blocks, so
    the dashboard's noise-floor and drift panels have data (0: the fixed table)."""
    argv = [python, "-m", "sidecar.cli", "demo", "--fault", fault, "--port", str(port),
            "--hold", f"{hold_s:g}", "--pace", f"{pace_s:g}", "--requests", str(requests),
            "--calibrate", str(calibrate)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    return Process(name, argv, workdir / f"{name}.log", env=env)


def prometheus_process(workdir: Path, binary: str, port: int, cfg: dict[str, Any]) -> Process:
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [binary, f"--config.file={path}", f"--storage.tsdb.path={workdir / 'prom-data'}",
            f"--web.listen-address={HOST}:{port}", "--web.enable-lifecycle"]
    return Process("prometheus", argv, workdir / "prometheus.log")


def alertmanager_process(workdir: Path, binary: str, port: int,
                         cfg: dict[str, Any]) -> Process:
    path = workdir / "alertmanager.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [binary, f"--config.file={path}", f"--storage.path={workdir / 'am-data'}",
            f"--web.listen-address={HOST}:{port}", "--cluster.listen-address="]
    return Process("alertmanager", argv, workdir / "alertmanager.log")


@contextlib.contextmanager
def stopping(procs: list[Process]) -> Iterator[list[Process]]:
    """Stop every process started inside the block, newest first, whatever happens."""
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


def _interrupt(signum: int, frame: object) -> None:
    """Unwind from wherever the script is (also mid start-up), so every started child is
    stopped by the ``stopping`` block."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Prometheus + Alertmanager + kv-sidecar demo "
                                             "on 127.0.0.1")
    ap.add_argument("--fault", default="zero-block", help="demo fault (`none` for clean)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--pace", type=float, default=0.05, help="seconds between requests")
    ap.add_argument("--hold", type=float, default=3600, help="serve metrics this long after")
    ap.add_argument("--interval", default="5s", help="scrape and rule evaluation interval")
    ap.add_argument("--prometheus-port", type=int, default=19090)
    ap.add_argument("--alertmanager-port", type=int, default=19093)
    ap.add_argument("--webhook-port", type=int, default=19096)
    ap.add_argument("--demo-port", type=int, default=19464)
    args = ap.parse_args(argv)

    prom_bin = find_binary("prometheus")
    am_bin = find_binary("prometheus-alertmanager", "alertmanager")
    if not prom_bin or not am_bin:
        print("needs prometheus and alertmanager on PATH "
              "(Debian: apt-get install prometheus prometheus-alertmanager)", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kv-sidecar-stack-"))
    pager = WebhookReceiver(args.webhook_port, echo=True)
    am_addr = f"{HOST}:{args.alertmanager_port}"
    procs: list[Process] = []
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack like Ctrl-C
    try:
        with stopping(procs):
            am = alertmanager_process(workdir, am_bin, args.alertmanager_port,
                                      alertmanager_config(pager.url, "10s", "1m"))
            procs.append(am.start())
            wait_http(f"http://{am_addr}/-/ready", 30, am)
            demo = demo_process(workdir, "demo", args.demo_port, args.fault, args.hold,
                                args.pace, args.requests)
            procs.append(demo.start())
            prom = prometheus_process(workdir, prom_bin, args.prometheus_port,
                                      prometheus_config([f"{HOST}:{args.demo_port}"],
                                                        am_addr, args.interval))
            procs.append(prom.start())
            wait_http(f"http://{HOST}:{args.prometheus_port}/-/ready", 60, prom)
            wait_http(f"http://{HOST}:{args.demo_port}/healthz", 90, demo)
            print(f"demo metrics  http://{HOST}:{args.demo_port}/metrics (fault={args.fault})\n"
                  f"prometheus    http://{HOST}:{args.prometheus_port}/alerts\n"
                  f"alertmanager  http://{am_addr}/#/alerts\n"
                  f"pager webhook {pager.url} (notifications print below)\n"
                  f"logs          {workdir}\nCtrl-C to stop.", flush=True)
            while demo.running():
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        pager.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print("stack stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
