"""Which ZMQ endpoints the sidecar may bind for ingest (probe pipe, KV events).

Neither socket is authenticated, so who can reach it is the access control: a
``tcp://127.0.0.1`` port (this host only) or an ``ipc://`` path under an allow-listed
directory, created 0600 (this user only). No torch, no vLLM: both ends import it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile

# The system's temp and runtime directories (where examples and tests put their sockets).
IPC_DIRS = tuple(dict.fromkeys(("/tmp", "/run", "/var/run", "/dev/shm", tempfile.gettempdir(),
                                os.environ.get("XDG_RUNTIME_DIR") or "/run")))


def _loopback_tcp(endpoint: str) -> bool:
    """``tcp://127.0.0.1:<port>`` exactly: a port of 1-5 ASCII digits in 1..65535 and nothing
    after it (ZMQ reads ``tcp://127.0.0.1:5;10.0.0.1:5`` as "from 127.0.0.1:5 to 10.0.0.1:5",
    so a prefix test let any address through)."""
    port = endpoint.removeprefix("tcp://127.0.0.1:")
    return port != endpoint and port.isascii() and port.isdigit() and len(port) <= 5 \
        and 0 < int(port) <= 65535


def _plain_path(path: str) -> bool:
    """An absolute path with no control character and no ``;`` (ZMQ's source separator)."""
    return path.startswith("/") and ";" not in path and path.isprintable()


def _local(endpoint: str, why: str) -> str | None:
    """The ``ipc://`` path of a local endpoint, None for ``tcp://127.0.0.1:<port>``;
    anything else is a ValueError ending with ``why``."""
    if endpoint.startswith("ipc://") and _plain_path(endpoint.removeprefix("ipc://")):
        return endpoint.removeprefix("ipc://")
    if _loopback_tcp(endpoint):
        return None
    raise ValueError(f"probe endpoint {endpoint[:80]!r} must be ipc://<absolute path> or "
                     f"tcp://127.0.0.1:<port>{why}")


# A unix socket's path must fit sockaddr_un's sun_path (108 bytes on Linux, with its NUL).
_MAX_SOCKET_PATH = 107


def _check_fits(ipc: str, what: str) -> None:
    """An ``ipc://`` path a unix socket can hold (ValueError otherwise)."""
    size = len(os.fsencode(ipc))
    if size > _MAX_SOCKET_PATH:
        raise ValueError(f"{what} path {ipc[:80]!r}... is {size} bytes: a unix socket's "
                         f"path holds at most {_MAX_SOCKET_PATH}")


def check_endpoint(endpoint: str, ipc_dirs: tuple[str, ...] = IPC_DIRS,
                   what: str = "probe socket") -> None:
    """Refuse endpoints any other host or user could send to, and ``ipc://`` paths a bind
    would clobber or cannot make (ValueError says why; ``what``: the socket, in words)."""
    ipc = _local(endpoint, f" (the {what} is not authenticated)")
    if ipc is None:
        return
    path = os.path.realpath(ipc)
    if not any(path == d or path.startswith(d.rstrip("/") + "/")
               for d in (os.path.realpath(d) for d in ipc_dirs)):
        raise ValueError(f"{what} {path!r} is not under an allowed directory "
                         f"{list(ipc_dirs)}")
    _check_fits(ipc, what)
    if not os.path.isdir(os.path.dirname(path)):
        raise ValueError(f"{what} {ipc!r}: directory {os.path.dirname(path)!r} does not "
                         "exist (create it first)")
    _check_free(ipc, what)


def _check_free(path: str, what: str) -> None:
    """ZMQ removes whatever is at an ``ipc://`` path it binds, without a word: refuse a
    path that holds anything but a socket (a mistyped ``--probe`` would delete the file),
    and a socket something still uses (binding would take it over: two sidecars' traffic
    mixed). Only a socket file that refuses connections (nobody bound to it: left by a
    process that died) is stale, and replaced; any other answer, a stream, datagram or
    seqpacket socket's (a stream connect to those fails with EPROTOTYPE), is a user."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ValueError(f"{what} path {path!r}: {exc.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"{path!r} exists and is not a socket: binding the {what} there "
                         "would delete it (choose another path)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return  # stale: nobody is bound there
    raise ValueError(f"{path!r} is in use: a process has a socket bound there (another "
                     f"sidecar?); stop it or choose another path for the {what}")


def bound_file(endpoint: str) -> int | None:
    """After a bind: the inode of an ``ipc://`` endpoint's socket file (None for tcp), for
    :func:`remove_bound_file`."""
    if not endpoint.startswith("ipc://"):
        return None
    return os.stat(endpoint.removeprefix("ipc://")).st_ino


def remove_bound_file(endpoint: str, inode: int | None) -> None:
    """After the bound socket closed: remove its file (ZMQ leaves it behind: one per run
    was left in /tmp), unless another bind has replaced it since (``inode`` differs)."""
    if inode is None:
        return
    path = endpoint.removeprefix("ipc://")
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def check_peer_endpoint(endpoint: str) -> None:
    """Refuse an endpoint an in-engine probe or tap would send KV to that is not on this
    host (ValueError says why): ``ipc://`` with an absolute path (any directory: the sidecar
    that binds it applies :func:`check_endpoint`, under its own temp directory) or
    ``tcp://127.0.0.1:<port>``; an ``ipc://`` path too long for a unix socket, which no
    sidecar could bind, is refused here too, at the engine's start."""
    ipc = _local(endpoint, ": the probe ships KV only to a sidecar on this host")
    if ipc is not None:
        _check_fits(ipc, "probe endpoint")
