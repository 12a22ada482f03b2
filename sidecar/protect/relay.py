"""The forwarding core's relay: send one complete request to the upstream and pass its
answer to the client as it arrives, under the upstream timeouts of
:class:`~sidecar.protect.wire.ForwardLimits` (connect, idle between bytes, total deadline).
A mixin of :class:`~sidecar.protect.forward.ForwardServer`."""

from __future__ import annotations

import logging
import socket
import time

from sidecar.protect.wire import HOP_BY_HOP, ForwardLimits, Request, error, status_of

log = logging.getLogger("sidecar.protect.forward")


class Relay:
    """The upstream half of :class:`~sidecar.protect.forward.ForwardServer`."""

    limits: ForwardLimits
    name: str
    upstream: tuple[str, int]

    def _count(self, key: str, status: int | None = None) -> None:
        raise NotImplementedError

    def _forward(self, client: socket.socket, req: Request, body: bytes) -> int | None:
        """Send the request to the upstream with ``Connection: close`` and relay its answer
        byte for byte until the upstream closes (its own framing, chunked SSE included,
        goes through untouched: nothing is parsed but the status line). Returns the status,
        or None when no complete answer reached the client."""
        lim = self.limits
        host, port = self.upstream
        head = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in req.headers if k.lower() not in HOP_BY_HOP]
        if body or req.method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body)}")
        head.append("Connection: close")
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        deadline = time.monotonic() + lim.response_deadline_s
        try:
            upstream = socket.create_connection((host, port), timeout=lim.connect_timeout_s)
        except OSError as exc:
            self._count("upstream_errors", 502)
            self._send(client, error(502, f"upstream unreachable: {exc}").encode())
            return None
        status: int | None = None
        try:
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.settimeout(lim.upstream_timeout_s)
            try:
                upstream.sendall(message + bytes(body) if len(body) < 65536 else message)
                if len(body) >= 65536:
                    upstream.sendall(body)
            except OSError as exc:
                self._count("upstream_errors", 502)
                self._send(client, error(502, f"upstream refused the request: {exc}").encode())
                return None
            first = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                upstream.settimeout(min(lim.upstream_timeout_s, left))
                chunk = upstream.recv(65536)
                if not chunk:
                    break
                if status is None:
                    first += chunk
                    if b"\r\n" not in first and len(first) < 1024:
                        continue
                    status = status_of(first)
                    if status is None:
                        self._count("upstream_errors", 502)
                        self._send(client, error(502, "upstream answered no HTTP").encode())
                        return None
                    chunk, first = first, b""
                if not self._send(client, chunk):
                    return None
        except TimeoutError:
            if status is None:
                self._count("upstream_errors", 504)
                self._send(client, error(504, "upstream timed out").encode())
            else:
                log.warning("%s: upstream answer stalled or past its deadline: cut", self.name)
                self._count("upstream_errors")
            return None
        except OSError as exc:
            log.info("%s: upstream answer broke off: %s", self.name, exc)
            self._count("upstream_errors", None if status else 502)
            if status is None:
                self._send(client, error(502, f"upstream failed: {exc}").encode())
            return None
        finally:
            upstream.close()
        if status is None:
            self._count("upstream_errors", 502)
            self._send(client, error(502, "upstream closed without an answer").encode())
        return status

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.sendall(data)
            return True
        except OSError:  # the client went away or stopped reading past write_timeout_s
            return False
