"""The forwarding core's relay: send one complete request to the upstream and pass its
answer to the client as it arrives, under the upstream timeouts of
:class:`~sidecar.protect.http_messages.ForwardLimits` (connect, idle between bytes, total deadline).
A mixin of :class:`~sidecar.protect.forward.ForwardServer`.

The connection to the upstream is kept alive (:mod:`sidecar.protect.upstream_pool`) when
the answer's end is certain (:mod:`sidecar.protect.framing`); the answer's bytes go to the
client as they arrive, its head with ``Connection: close`` instead of the upstream's
connection headers. An answer cut short (fewer bytes than its length, a chunked stream that
stops before its last chunk) is an upstream error: the client's connection is closed on it,
and the proxy's app is not told of an answer.
"""

from __future__ import annotations

import logging
import socket
import time

from sidecar.protect.framing import (
    MAX_HEAD_BYTES,
    AnswerHead,
    BadAnswer,
    ChunkedEnd,
    parse_answer_head,
)
from sidecar.protect.http_messages import HOP_BY_HOP, ForwardLimits, Request, error
from sidecar.protect.upstream_pool import UpstreamPool

log = logging.getLogger("sidecar.protect.forward")
READ_BYTES = 256 * 1024  # one read of an answer's body: few, large writes to the client


class _Retry(Exception):
    """A reused connection the upstream had closed: send the request again on a new one."""


class _Cut(Exception):
    """The answer stopped before its end (already counted)."""


class Relay:
    """The upstream half of :class:`~sidecar.protect.forward.ForwardServer`."""

    limits: ForwardLimits
    name: str
    upstream: tuple[str, int]
    _pool: UpstreamPool

    def _count(self, key: str, status: int | None = None) -> None:
        raise NotImplementedError

    def _forward(self, client: socket.socket, req: Request, body: bytes) -> int | None:
        """Send the request to the upstream and relay its answer. Returns the status, or
        None when no complete answer reached the client. A reused connection that the
        upstream closed before a byte of the answer is retried once on a fresh one (the
        server never read the request: it closed an idle connection)."""
        host, port = self.upstream
        head = [f"{req.method} {req.path} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in req.headers if k.lower() not in HOP_BY_HOP]
        if body or req.method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body)}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        deadline = time.monotonic() + self.limits.response_deadline_s
        for attempt in range(2):
            try:
                upstream, reused = self._pool.take()
            except OSError as exc:
                self._count("upstream_errors", 502)
                self._send(client, error(502, f"upstream unreachable: {exc}").encode())
                return None
            keep = False
            try:
                status, keep = self._exchange(client, upstream, req, message, body, deadline,
                                              reused and attempt == 0)
                return status
            except _Retry:
                continue
            except _Cut:
                return None
            finally:
                if keep:
                    self._pool.give(upstream)
                else:
                    upstream.close()
        return None  # pragma: no cover - the second attempt never raises _Retry

    def _exchange(self, client: socket.socket, upstream: socket.socket, req: Request,
                  message: bytes, body: bytes, deadline: float,
                  may_retry: bool) -> tuple[int | None, bool]:
        """One request and its answer on ``upstream``: (status or None, reusable)."""
        lim = self.limits
        try:
            upstream.settimeout(lim.upstream_timeout_s)
            if len(body) < 65536:
                upstream.sendall(message + body)
            else:
                upstream.sendall(message)
                upstream.sendall(body)
        except OSError as exc:
            if may_retry:
                raise _Retry from exc
            self._count("upstream_errors", 502)
            self._send(client, error(502, f"upstream refused the request: {exc}").encode())
            return None, False
        try:
            answer, rest = self._answer_head(upstream, req, deadline, may_retry)
        except TimeoutError:
            self._count("upstream_errors", 504)
            self._send(client, error(504, "upstream timed out").encode())
            return None, False
        except (BadAnswer, OSError) as exc:
            self._count("upstream_errors", 502)
            self._send(client, error(502, str(exc) if isinstance(exc, BadAnswer)
                                     else f"upstream failed: {exc}").encode())
            return None, False
        try:
            complete, clean = self._body(client, upstream, answer, rest, deadline)
        except TimeoutError:
            log.warning("%s: upstream answer stalled or past its deadline: cut", self.name)
            self._count("upstream_errors")
            raise _Cut from None
        except (BadAnswer, OSError) as exc:
            log.info("%s: upstream answer broke off: %s", self.name, exc)
            self._count("upstream_errors")
            raise _Cut from None
        if not complete:
            return None, False
        return answer.status, clean and answer.reusable

    def _recv(self, upstream: socket.socket, deadline: float, size: int) -> bytes:
        """One read within both the idle timeout (set on the socket before the request)
        and the answer's deadline (set instead when it is the nearer one)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if left < self.limits.upstream_timeout_s:
            upstream.settimeout(left)
        return upstream.recv(size)

    def _answer_head(self, upstream: socket.socket, req: Request, deadline: float,
              may_retry: bool) -> tuple[AnswerHead, bytes]:
        """The answer's head and the bytes read past it; raises BadAnswer, OSError,
        TimeoutError, or _Retry (a reused connection closed before any byte)."""
        buf = b""
        while True:
            try:
                chunk = self._recv(upstream, deadline, 65536)
            except (ConnectionResetError, BrokenPipeError) as exc:
                if may_retry and not buf:
                    raise _Retry from exc
                raise
            if not chunk:
                if may_retry and not buf:
                    raise _Retry
                raise BadAnswer("upstream closed without an answer")
            start = max(0, len(buf) - 3)
            buf += chunk
            end = buf.find(b"\r\n\r\n", start)
            if end >= 0:
                return parse_answer_head(buf[:end], req.method), buf[end + 4:]
            if len(buf) > MAX_HEAD_BYTES:
                raise BadAnswer("upstream answer head too large")

    def _body(self, client: socket.socket, upstream: socket.socket, answer: AnswerHead,
              rest: bytes, deadline: float) -> tuple[bool, bool]:
        """Relay the body: (the client got all of it, no byte past its end arrived)."""
        chunks = ChunkedEnd() if answer.chunked else None
        left = answer.length
        out = answer.head
        data = rest
        while True:
            extra = False
            if chunks is not None:
                end = chunks.feed(data) if data else -1
                if end >= 0:
                    extra, data = end < len(data), data[:end]
            elif left is not None:
                extra, data = len(data) > left, data[:left]
                left -= len(data)
            if out or data:
                if not self._send(client, out + data if out else data):
                    return False, False
                out = b""
            if (chunks is not None and chunks.done) or left == 0:
                return True, not extra
            data = self._recv(upstream, deadline, READ_BYTES)
            if not data:
                if chunks is None and left is None:
                    return True, False  # framed by the close: complete
                self._count("upstream_errors")
                log.info("%s: upstream closed its answer before its end", self.name)
                return False, False

    def _send(self, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.sendall(data)
            return True
        except OSError:  # the client went away or stopped reading past write_timeout_s
            return False

