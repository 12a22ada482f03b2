"""What the real-engine benches (``bench perf --engine vllm|sglang``) share: a configuration's
processes (the engine's server, and the sidecar beside it when on), finding the engine's
interpreter, waiting for health, their CPU from /proc, the sidecar's settled /status, the
workload with shared prefixes and the client threads that drive it.

Nothing here imports an engine: every engine process is a subprocess of its own interpreter
(``.venv-vllm``, ``.venv-sglang``), so the benches run from any environment.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtestbed.bench.perf_drive import Api, drive
from kvtestbed.bench.proc_cost import group_cpu_s, group_threads_cpu_s

BLOCK = 32  # the workload's prefix unit (tokens); each engine blocks it its own way


class EngineMissing(RuntimeError):
    """No interpreter with the engine: the bench exits 2 with this message."""


def source_root() -> Path:
    """The checkout the bench runs from (the sidecar package's parent): put first on the
    servers' PYTHONPATH, so the probe or tap the engine loads is this one, not a venv's
    editable copy."""
    import sidecar

    return Path(sidecar.__file__).resolve().parents[1]


def find_engine_python(explicit: str | None, package: str, venv: str, builder: str,
                       label: str) -> str:
    """``explicit``, else this interpreter if it imports ``package``, else ``venv/bin/python``
    (in the current directory or the checkout). Raises :class:`EngineMissing` naming the
    engine (``label``) and the ``builder`` (the make target that builds the venv)."""
    import importlib.util
    import sys

    if explicit:
        candidates = [Path(explicit)]
    elif importlib.util.find_spec(package) is not None:
        return sys.executable
    else:
        rel = Path(venv) / "bin" / "python"
        candidates = [Path.cwd() / rel, source_root() / rel]
    for py in candidates:
        if py.exists():
            ok = subprocess.run([str(py), "-c", "import importlib.util as u, sys; "
                                 f"sys.exit(u.find_spec({package!r}) is None)"],
                                capture_output=True, timeout=60).returncode == 0
            if ok:
                return str(py)
            raise EngineMissing(f"{py} has no {package} package ({builder} builds {venv})")
    raise EngineMissing(f"no {label} environment: {candidates[0]} not found ({builder} "
                        f"builds {venv}, or pass --{package}-python)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One configuration's processes, each with its role (``sidecar``, the engine's name):
    the engine, and with the sidecar on the sidecar beside it."""

    name: str
    sample_every: int | None  # None: the sidecar's engine side off; 0: events only (vLLM)
    url: str
    rundir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    sidecar_url: str | None = None
    burst_hits: int = 0  # the probe's start burst (sampled at a higher rate), to warm past

    def spawn(self, role: str, cmd: list[str], env: dict[str, str]) -> None:
        """Start ``cmd`` in a session of its own (its process group is what is counted and
        stopped), its output in ``rundir/ROLE.log``."""
        with open(self.rundir / f"{role}.log", "wb") as f:  # the child keeps its own handle
            self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               env=env, start_new_session=True))
        self.roles.append(role)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def log_tail(self, n: int = 1500) -> str:
        out = []
        for f in sorted(self.rundir.glob("*.log")):
            out.append(f"--- {f.name}: " + f.read_text(errors="replace")[-n:])
        return "\n".join(out)


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def wait_ready(servers: list[Server], timeout_s: float) -> None:
    """Until every server answers /health (and its sidecar /healthz); raises with the logs
    of the first one that died or did not answer in time."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for srv in list(pending):
            if not srv.alive():
                raise RuntimeError(f"{srv.name}: a process exited\n{srv.log_tail()}")
            try:
                _get(f"{srv.url}/health", 2)
                if srv.sidecar_url:
                    _get(f"{srv.sidecar_url}/healthz", 2)
                pending.remove(srv)
            except OSError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name}: not ready in {timeout_s:.0f}s\n"
                               f"{pending[0].log_tail()}")
        if pending:
            time.sleep(0.5)


def cpu_by_role(srv: Server) -> dict[str, float]:
    """CPU seconds so far of this configuration's process groups, by role (the engine's;
    the sidecar's when on)."""
    return {role: group_cpu_s(p.pid) for role, p in zip(srv.roles, srv.procs, strict=True)}


def engine_threads(srv: Server, engine: str) -> dict[str, float]:
    """CPU seconds per thread name of ``engine``'s process group (the role that runs it)."""
    return group_threads_cpu_s(srv.procs[srv.roles.index(engine)].pid)


def sidecar_status(srv: Server) -> dict[str, Any] | None:
    if not srv.sidecar_url:
        return None
    try:
        return dict(json.loads(_get(f"{srv.sidecar_url}/status", 10)))
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def settled_status(srv: Server, timeout_s: float = 15.0) -> dict[str, Any] | None:
    """:func:`sidecar_status` once its lookup count holds still for a second (the probe
    ships its counts at least once a second; a loaded machine delays them)."""
    last = sidecar_status(srv)
    deadline = time.monotonic() + timeout_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(1.0)
        now = sidecar_status(srv)
        if now is None or now.get("lookups") == last.get("lookups"):
            return now
        last = now
    return last


@contextlib.contextmanager
def alone(srv: Server, servers: list[Server]) -> Iterator[None]:
    """``srv`` runs alone: every other configuration's process groups are stopped
    (SIGSTOP) while it is driven, and continued after. On a small machine an idle engine
    is not idle: its OpenMP workers spin after each forward and its scheduler polls, and
    the servers of one bench run measured 15-20% apart for the same requests, whichever
    carried the sidecar. Stopped, the others take no CPU."""
    others = [p for s in servers if s is not srv for p in s.procs if p.poll() is None]
    for p in others:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in others:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)


def stop(servers: list[Server]) -> None:
    """SIGTERM each process group this module started (and SIGCONT, should one be stopped
    by :func:`alone`), SIGKILL what is left after 20 s."""
    procs = [p for s in servers for p in s.procs]
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
                os.killpg(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    for s in servers:
        shutil.rmtree(s.rundir, ignore_errors=True)


def workload(seed: int, requests: int, prefixes: int = 8, suffix: int = 12
             ) -> list[list[int]]:
    """``requests`` prompts over ``prefixes`` shared prefixes of 2-6 blocks (round robin),
    each followed by a fresh suffix: after a prefix's first request, every one is a prefix
    hit. A new seed gives new prefixes, so every round starts from a cold prefix."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(BLOCK * (2 + i % 5) + 6)]
             for i in range(prefixes)]
    return [heads[i % prefixes] + [rng.randrange(3, 500) for _ in range(suffix)]
            for i in range(requests)]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved_rounds(engine: str, by_name: dict[str, Server], api: Api, pairs: int,
                       requests: int, concurrency: int, max_tokens: int,
                       ready_timeout_s: float = 600.0, started: float | None = None,
                       counters: tuple[str, ...] = ()) -> dict[str, Any]:
    """Wait for every configuration (already starting; the first is "off"), warm each up
    alike, run ``pairs`` rounds, stop them all; the raw figures and, per configuration but
    "off", each pair's ratio to "off" (tokens/s, P50, P99, CPU of ``engine``'s and the
    sidecar's processes against ``engine``'s off) with the median and min..max over pairs.

    A round runs every configuration once on the same prompts, in an order rotated by one
    each round (drift and ordering cancel over rounds), each alone (:func:`alone`: the
    others stopped); each round draws new shared
    prefixes, so every run starts from a cold prefix and then hits. ``started``: when the
    servers were started (for the start-up time reported; default: now); ``counters``: the
    engine's /metrics counters kept per run (:mod:`kvtestbed.bench.engine_counters`)."""
    from kvtestbed.bench import engine_counters
    servers = list(by_name.values())
    names = list(by_name)
    started = time.monotonic() if started is None else started
    try:
        wait_ready(servers, ready_timeout_s)
        startup_s = time.monotonic() - started
        _progress(f"bench perf --engine {engine}: {len(servers)} servers up in "
                  f"{startup_s:.0f}s")
        # Warm-up, alike on every server, past a probe's start burst (its first hits are
        # sampled at a higher rate): the rounds measure the steady state.
        burst = max(s.burst_hits for s in servers)
        warm = workload(10_000, max(64, requests // 4, burst + 64))
        for srv in servers:
            with alone(srv, servers):
                drive(srv.url, api, warm, concurrency, max_tokens, f"{srv.name}, warm-up")
        after_warmup = {name: settled_status(srv) for name, srv in by_name.items()
                        if srv.sidecar_url}
        rounds: list[dict[str, Any]] = []
        for r in range(pairs):
            prompts = workload(r, requests)
            order = [names[(r + k) % len(names)] for k in range(len(names))]
            runs = {}
            for name in order:
                before = cpu_by_role(by_name[name])
                threads_before = engine_threads(by_name[name], engine)
                said = engine_counters.read(by_name[name].url, counters)
                with alone(by_name[name], servers):
                    runs[name] = drive(by_name[name].url, api, prompts, concurrency,
                                       max_tokens, f"{name}, round {r + 1}")
                after = cpu_by_role(by_name[name])
                threads_after = engine_threads(by_name[name], engine)
                runs[name]["engine_counters"] = engine_counters.delta(
                    said, engine_counters.read(by_name[name].url, counters))
                runs[name]["cpu_s"] = {k: after[k] - before[k] for k in after}
                runs[name]["threads_cpu_s"] = {
                    t: round(v - threads_before.get(t, 0.0), 3)
                    for t, v in threads_after.items()}
            rounds.append({"order": order, "runs": runs})
            _progress(f"bench perf --engine {engine}: round {r + 1}/{pairs}: " + ", ".join(
                f"{n} {runs[n]['tokens_per_s']:.0f} tok/s" for n in names))
        status = {name: {"after_warmup": after_warmup[name], "end": settled_status(srv)}
                  for name, srv in by_name.items() if srv.sidecar_url}
    finally:
        stop(servers)
    out: dict[str, Any] = {"startup_s": startup_s, "warmup_requests": len(warm),
                           "rounds": rounds, "sidecar_status": status, "ratios": {}}
    off = names[0]
    for name in names[1:]:
        per = {k: [rd["runs"][name][m] / rd["runs"][off][m] for rd in rounds]
               for k, m in (("tokens_per_s", "tokens_per_s"), ("p50", "p50_s"),
                            ("p99", "p99_s"))}
        off_cpu = [rd["runs"][off]["cpu_s"][engine] for rd in rounds]
        for role in (engine, "sidecar"):
            per[f"{role}_cpu"] = [rd["runs"][name]["cpu_s"].get(role, 0.0) / max(c, 1e-9)
                                  for rd, c in zip(rounds, off_cpu, strict=True)]
        out["ratios"][name] = {k: {"pairs": v, **_summary(v)} for k, v in per.items()}
    return out


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
