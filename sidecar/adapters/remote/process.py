"""``dispatch = "process"`` from the engine's side: start the sidecar process, hand the
engine its front, and ask the sidecar for what a Monitor would answer in-process.

::

    sidecar = SidecarProcess(adapter, SidecarConfig(dispatch="process"), port=9464).start()
    engine.sink = sidecar.front           # the hooks: O(1), then shipped
    ...
    sidecar.drain(); print(sidecar.summary()); sidecar.stop()

The engine's process keeps the front (:mod:`.front`: hooks, sampler, capture, shipper);
the spawned process (:mod:`.child`) keeps everything else, ``/metrics`` and ``/status``
included. The adapter must offer ``remote_reference`` (a picklable factory of the
reference the sidecar process recomputes with): the reference engine's adapter does. What
needs the Monitor beside the engine is not offered in this mode: protective actions (the
circuit breaker, quarantine), the scrubber (it reads blocks on its own schedule), rereads.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import secrets
import tempfile
import threading
import uuid
from typing import Any

from sidecar.adapters.remote.child import child_main
from sidecar.adapters.remote.front import EngineFront
from sidecar.config.settings import SidecarConfig
from sidecar.core import attach
from sidecar.core.protocol import Adapter, EngineInfo

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # a spawned interpreter importing torch and building its reference


class SidecarProcessError(RuntimeError):
    """The sidecar process could not start or answer; ``str()`` says why in one line."""


class SidecarProcess:
    """See the module docstring. ``port``: serve ``/metrics`` there (0: any free port;
    ``None``: none); ``token``: the bearer token for ``/status``."""

    def __init__(self, adapter: Adapter, config: SidecarConfig | None = None,
                 info: EngineInfo | None = None, port: int | None = None,
                 token: str | None = None, endpoint: str | None = None) -> None:
        self.config = config or SidecarConfig(dispatch="process")
        self.config.validate()
        self.info = info or adapter.describe()
        factory = attach.resolve(adapter, quiet=True).remote_reference
        if factory is None:
            raise SidecarProcessError(
                f"dispatch = 'process' needs an adapter that offers remote_reference (how "
                f"the sidecar process builds its reference); {type(adapter).__name__} does "
                "not: use dispatch = 'queued'")
        self.endpoint = endpoint or (f"ipc://{tempfile.gettempdir()}/kvsidecar-"
                                     f"{uuid.uuid4().hex[:12]}.sock")
        path = self.endpoint.removeprefix("ipc://")
        if self.endpoint.startswith("ipc://") and os.path.exists(path):
            # binding would take the socket from whoever listens there (their traffic and
            # ours mixed: a false hit_counter_mismatch in an outside check)
            raise SidecarProcessError(f"{self.endpoint} is in use (a socket file is there); "
                                      "leave endpoint unset for a fresh one")
        # The front's messages carry it as their src; the sidecar process accepts no other
        # sender (any process of the same user may connect to the 0600 socket).
        secret = secrets.token_hex(16)
        ctx = multiprocessing.get_context("spawn")  # never fork a process with threads
        self._conn, child_conn = ctx.Pipe()
        http = None if port is None else {"port": port, "token": token}
        self.process = ctx.Process(
            target=child_main, name="kv-sidecar", daemon=True,
            args=(self.endpoint, self.info, self.config, factory(), child_conn, http,
                  logging.getLogger().getEffectiveLevel(), secret))
        self.front = EngineFront(adapter, self.info, self.config, self.endpoint, src=secret)
        self._state = "new"  # -> running -> stopped
        self.url: str | None = None
        self._mark = 0
        self._lock = threading.Lock()

    @property
    def requests_done(self) -> int:
        """Requests the engine reported done so far (the front's count)."""
        return self.front.requests_posted

    def start(self, timeout_s: float = START_TIMEOUT_S) -> SidecarProcess:
        """Spawn the sidecar process and wait until it listens; then start shipping.
        Idempotent while running; a stopped one cannot start again (make a new one)."""
        if self._state == "running":
            return self
        if self._state == "stopped":
            raise SidecarProcessError("this sidecar process was stopped: start a new one")
        self._state = "running"
        # an engine that exits without stop() still stops it (multiprocessing would
        # terminate the daemon process, leaving its socket file behind)
        atexit.register(self.stop)
        self.process.start()
        try:
            detail = self._ready(timeout_s)
        except SidecarProcessError:
            self._state = "stopped"  # nothing to stop: the process is gone or killed
            atexit.unregister(self.stop)
            self.front.pipe.close()
            raise
        self.url = detail
        self.front.start()
        return self

    def _ready(self, timeout_s: float) -> str | None:
        """The sidecar process's first word: its /metrics URL, or why it did not start."""
        if not self._conn.poll(timeout_s):
            self.process.kill()
            raise SidecarProcessError(f"the sidecar process did not start in {timeout_s:g}s")
        try:
            status, detail = self._conn.recv()
        except (EOFError, OSError):  # it died first (a script without a __main__ guard)
            self.process.join(5)
            raise SidecarProcessError(
                f"the sidecar process exited while starting (code {self.process.exitcode}); "
                "a script that starts one needs an `if __name__ == \"__main__\":` guard "
                "(the process is spawned)") from None
        if status != "ready":
            self.process.join(5)
            raise SidecarProcessError(f"the sidecar process failed to start: {detail}")
        return detail

    def _call(self, cmd: str, *args: Any, timeout_s: float = 60.0) -> Any:
        with self._lock:
            if not self.process.is_alive():
                raise SidecarProcessError(
                    f"the sidecar process is not running (exit code {self.process.exitcode})")
            self._conn.send((cmd, *args))
            if not self._conn.poll(timeout_s):
                raise SidecarProcessError(f"the sidecar process did not answer {cmd!r} in "
                                          f"{timeout_s:g}s")
            status, reply = self._conn.recv()
        if status != "ok":
            raise SidecarProcessError(f"{cmd}: {reply}")
        return reply

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Every event so far applied by the sidecar and every sample verified; False on
        timeout (a lost mark: the pipe was full)."""
        self._mark += 1
        self.front.sync(self._mark)
        return bool(self._call("drain", self._mark, timeout_s, timeout_s=2 * timeout_s + 5))

    def poll_allocator(self) -> None:
        """A census now (the sidecar checks each as it arrives), and wait for it."""
        self.front.request_census()
        self.drain()

    def summary(self) -> dict[str, Any]:
        """The sidecar's ``/status`` (a Monitor's ``summary()``), from its process."""
        return dict(self._call("summary"))

    def health(self) -> dict[str, Any]:
        return dict(self._call("health"))

    def cpu_seconds(self) -> float:
        """The sidecar process's CPU time so far (``time.process_time`` there)."""
        return float(self._call("cpu"))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ship what waits, stop the sidecar process (killed past ``timeout_s``), remove
        its socket file. Idempotent; a no-op before :meth:`start`."""
        if self._state != "running":  # never started, or stopped already: nothing to do
            return
        self._state = "stopped"
        atexit.unregister(self.stop)
        self.front.stop()
        try:
            if self.process.is_alive():
                self._call("stop", timeout_s=timeout_s)
        except SidecarProcessError as exc:
            log.warning("kv-sidecar process: %s", exc)
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        if self.endpoint.startswith("ipc://"):  # the child removes it, unless it was killed
            with contextlib.suppress(OSError):
                os.unlink(self.endpoint.removeprefix("ipc://"))
