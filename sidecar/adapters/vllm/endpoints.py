"""Which ZMQ endpoints the sidecar may bind for ingest (probe pipe, KV events).

Neither socket is authenticated, so who can reach it is the access control: a
``tcp://127.0.0.1`` port (this host only) or an ``ipc://`` path under an allow-listed
directory, created 0600 (this user only). No torch, no vLLM: both ends import it.
"""

from __future__ import annotations

import os
import tempfile

# The system's temp and runtime directories (where examples and tests put their sockets).
IPC_DIRS = tuple(dict.fromkeys(("/tmp", "/run", "/var/run", "/dev/shm", tempfile.gettempdir(),
                                os.environ.get("XDG_RUNTIME_DIR") or "/run")))


def check_endpoint(endpoint: str, ipc_dirs: tuple[str, ...] = IPC_DIRS) -> None:
    """Refuse endpoints any other host or user could send to (ValueError says why)."""
    if endpoint.startswith("ipc://"):
        path = os.path.realpath(endpoint.removeprefix("ipc://"))
        if not any(path == d or path.startswith(d.rstrip("/") + "/")
                   for d in (os.path.realpath(d) for d in ipc_dirs)):
            raise ValueError(f"probe socket {path} is not under an allowed directory "
                             f"{list(ipc_dirs)}")
        return
    if endpoint.startswith("tcp://127.0.0.1:"):
        return
    raise ValueError(f"probe endpoint {endpoint!r} must be ipc://<path> or "
                     f"tcp://127.0.0.1:<port> (the probe pipe is not authenticated)")


def check_peer_endpoint(endpoint: str) -> None:
    """Refuse an endpoint an in-engine probe or tap would send KV to that is not on this
    host (ValueError says why): ``ipc://`` (any path: the sidecar that binds it applies
    :func:`check_endpoint`, under its own temp directory) or ``tcp://127.0.0.1:<port>``."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    if endpoint.startswith("tcp://127.0.0.1:"):
        return
    raise ValueError(f"probe endpoint {endpoint!r} must be ipc://<path> or "
                     f"tcp://127.0.0.1:<port>: the probe ships KV only to a sidecar on this host")
