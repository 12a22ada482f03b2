"""The server's address, and the rule that keeps the canary on loopback unless told.

A canary sends unique prompts at a steady rate; pointed at the wrong host by a typo it would
load someone else's production server. So a non-loopback endpoint is refused unless the
operator passes ``--allow-remote`` explicitly, and tests never pass it.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit


class CanaryError(Exception):
    """Bad input or an unusable server: printed without a traceback, exit code 2."""


@dataclass(frozen=True)
class Endpoint:
    """``base`` is the API root (``http://host:port/v1``); ``root`` is ``http://host:port``
    (where ``/metrics`` and ``/health`` live)."""

    scheme: str
    host: str
    port: int
    path: str

    @property
    def root(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def base(self) -> str:
        return self.root + self.path


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(str(a)).is_loopback for a in addrs)


def parse_endpoint(url: str, allow_remote: bool = False,
                   why: str = "the canary sends probe traffic") -> Endpoint:
    """Parse ``http://host:port/v1``; a clear :class:`CanaryError` for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise CanaryError(f"bad endpoint {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CanaryError(f"bad endpoint {url!r}: expected http://HOST:PORT/v1")
    if parts.query or parts.fragment:
        raise CanaryError(f"bad endpoint {url!r}: no query or fragment expected")
    host = parts.hostname
    if not allow_remote and not is_loopback(host):
        raise CanaryError(f"endpoint {url!r} is not a loopback address; {why}, so pass "
                          "--allow-remote to point it elsewhere")
    path = parts.path.rstrip("/") or "/v1"
    return Endpoint(parts.scheme, host, port or (443 if parts.scheme == "https" else 80),
                    path)
