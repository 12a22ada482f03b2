"""Where an upstream's HTTP/1.1 answer ends, read off the bytes the relay passes on anyway:
what lets the forwarding core keep its connection to the upstream open for the next request
(:mod:`sidecar.protect.upstream_pool`) without buffering or re-encoding a byte of the answer.

An answer whose end cannot be told for certain (no length and not chunked, HTTP/1.0, a
``Connection: close``, a 1xx, a malformed chunk) is relayed until the upstream closes, as
before keep-alive, and its connection is not reused: a proxy that guesses an answer's end
wrongly would hand the rest of it to the next user.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024  # an upstream's answer head larger than this is a 502
MAX_CHUNK_LINE = 4096  # a chunk-size line (with extensions) or a trailer line
NO_BODY_STATUSES = frozenset({204, 304})
_CLIENT_HOP = frozenset({"connection", "keep-alive", "proxy-connection"})


class BadAnswer(Exception):
    """The upstream's answer is not HTTP the relay can pass on."""


@dataclass
class AnswerHead:
    status: int
    head: bytes  # the head for the client: the upstream's, closing the client's connection
    length: int | None  # body bytes after the head; None: chunked or until close
    chunked: bool
    reusable: bool  # the upstream connection may serve another request after this answer


def parse_answer_head(raw: bytes, method: str) -> AnswerHead:
    """The head of an upstream answer (``raw`` ends before the blank line); raises
    :class:`BadAnswer`. The client's copy keeps every header but the connection ones and
    says ``Connection: close`` (the guard answers one request per client connection)."""
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() \
            or len(parts[1]) != 3:
        raise BadAnswer("upstream answered no HTTP")
    status = int(parts[1])
    keep = parts[0] == b"HTTP/1.1"
    lengths: set[bytes] = set()
    chunked = False
    out = [lines[0]]
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadAnswer("upstream answered a malformed header line")
        low = name.lower().decode("latin-1")
        value = value.strip()
        if low == "connection":
            keep = keep and b"close" not in value.lower()
        elif low == "content-length":
            lengths.add(value)
        elif low == "transfer-encoding":
            chunked = value.lower() == b"chunked"
            keep = keep and chunked  # another coding: framed by the close alone
        if low not in _CLIENT_HOP:
            out.append(line)
    out.append(b"Connection: close")
    head = b"\r\n".join(out) + b"\r\n\r\n"
    if 100 <= status < 200:  # interim answers: relay to the close, do not reuse
        return AnswerHead(status, head, None, False, False)
    if method == "HEAD" or status in NO_BODY_STATUSES:
        return AnswerHead(status, head, 0, False, keep)
    if chunked:
        if lengths:  # both framings: the smuggling shape; trust neither, never reuse
            return AnswerHead(status, head, None, False, False)
        return AnswerHead(status, head, None, True, keep)
    if len(lengths) > 1:
        raise BadAnswer("upstream answered conflicting Content-Length headers")
    if lengths:
        text = lengths.pop()
        if not text.isdigit() or len(text) > 18:
            raise BadAnswer("upstream answered a bad Content-Length")
        return AnswerHead(status, head, int(text), False, keep)
    return AnswerHead(status, head, None, False, False)  # to the close


class ChunkedEnd:
    """Follows chunked framing over the bytes as they are relayed (nothing is copied out but
    size and trailer lines): :meth:`feed` returns how many bytes of ``data`` belong to the
    answer, -1 while all of it does and the answer is not over; :attr:`done` once the last
    chunk and the trailers went by. Raises :class:`BadAnswer` on broken framing."""

    def __init__(self) -> None:
        self._state = "size"
        self._left = 0  # data bytes left in this chunk, or CRLF bytes left after it
        self._line = bytearray()
        self.done = False

    def feed(self, data: bytes | memoryview) -> int:
        i, n = 0, len(data)
        while i < n:
            if self._state == "data":
                take = min(self._left, n - i)
                i += take
                self._left -= take
                if not self._left:
                    self._state, self._left = "crlf", 2
                continue
            if self._state == "crlf":
                if data[i] != b"\r\n"[2 - self._left]:
                    raise BadAnswer("upstream chunk not followed by CRLF")
                i += 1
                self._left -= 1
                if not self._left:
                    self._state = "size"
                continue
            j = bytes(data[i:min(n, i + MAX_CHUNK_LINE + 2)]).find(b"\n")
            if j < 0:
                self._line += data[i:]
                i = n
            else:
                self._line += data[i:i + j + 1]
                i += j + 1
            if len(self._line) > MAX_CHUNK_LINE:
                raise BadAnswer("upstream chunk line too long")
            if j < 0:
                continue
            line = bytes(self._line).rstrip(b"\r\n")
            self._line.clear()
            if self._state == "size":
                size = line.split(b";", 1)[0].strip()
                if not size or len(size) > 15 or \
                        any(c not in b"0123456789abcdefABCDEF" for c in size):
                    raise BadAnswer("upstream answered a bad chunk size")
                self._left = int(size, 16)
                self._state = "data" if self._left else "trailer"
            elif not line:  # the blank line after the last chunk's trailers
                self.done = True
                return i
        return -1
