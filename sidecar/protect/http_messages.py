"""What the forwarding core (:mod:`sidecar.protect.forward`) reads and writes: its limits,
a parsed request, the answers it gives itself, and the strict parse of a request head (a
forwarding proxy passes on only what it understood: one length, no chunked requests, no
absolute-form targets)."""

from __future__ import annotations

import http
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                        "proxy-authorization", "te", "trailers", "transfer-encoding",
                        "upgrade", "host", "content-length", "expect"})
_REASONS = {400: "Bad Request", 404: "Not Found", 408: "Request Timeout",
            411: "Length Required", 413: "Content Too Large", 417: "Expectation Failed",
            431: "Request Header Fields Too Large", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout"}
MAX_HEADERS = 100


def _reason(status: int) -> str:
    """The reason phrase: the standard one (a 401 once went out as "401 OK")."""
    if status in _REASONS:
        return _REASONS[status]
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "OK" if 200 <= status < 300 else "Error"


_UNUSUAL_PATH = ("%", "//", "/.", "://")  # what normal_path has work to do on
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 5.6.2)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CTLs but HTAB (RFC 9110 5.5)


@dataclass(frozen=True)
class ForwardLimits:
    """The bounds of one proxy (see the module docstring for why each exists)."""

    max_connections: int = 256
    workers: int = 32
    request_deadline_s: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 8 * 1024 * 1024
    buffer_budget_bytes: int = 64 * 1024 * 1024
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 120.0
    response_deadline_s: float = 600.0
    write_timeout_s: float = 30.0
    upstream_idle_s: float = 2.0  # a kept-alive upstream connection idle longer is closed

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_body_bytes > self.buffer_budget_bytes:
            raise ValueError("max_body_bytes must not exceed buffer_budget_bytes")


@dataclass
class Request:
    """One complete request as the client sent it (headers in order, names as sent)."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    peer: str = ""
    meta: dict[str, object] = field(default_factory=dict)  # what a ForwardApp notes on it

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)

    @property
    def route(self) -> str:
        return self.path.split("?", 1)[0]


@dataclass
class Reply:
    """An answer the proxy gives itself (an error, or a path a :class:`ForwardApp` owns)."""

    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)

    def encode(self) -> bytes:
        head = [f"HTTP/1.1 {self.status} {_reason(self.status)}",
                f"Content-Type: {self.content_type}", f"Content-Length: {len(self.body)}",
                "Connection: close", *(f"{k}: {v}" for k, v in self.headers)]
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body


def normal_path(target: str) -> str:
    """The path a server routes ``target`` to: absolute form reduced to its path, query
    dropped, %-escapes decoded, ``//`` collapsed, ``.``/``..`` resolved, no trailing slash.
    A proxy that decides on the raw target can be walked round (``/v1//completions``,
    ``/v1/../v1/completions``, ``/v1/completions/``) by paths the server treats alike."""
    path = target.partition("?")[0]
    if not any(s in path for s in _UNUSUAL_PATH) and not path.endswith("/"):
        return path  # the common case: nothing to normalise
    if "://" in target.split("?", 1)[0]:
        target = urllib.parse.urlsplit(target).path or "/"
    path = urllib.parse.unquote(target.split("?", 1)[0])
    parts: list[str] = []
    for seg in path.split("/"):
        if seg == "..":
            if parts:
                parts.pop()
        elif seg not in ("", "."):
            parts.append(seg)
    return "/" + "/".join(parts)


def error(status: int, message: str) -> Reply:
    return Reply(status, (message + "\n").encode())


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]], int]:
    """Method, target, headers and body length of a request head; :class:`BadRequest` for
    anything a forwarding proxy cannot pass on safely."""
    flat = head.replace(b"\r\n", b"")
    if b"\n" in flat or b"\r" in flat or b"\x00" in flat:
        # A bare LF or CR inside a line: a server that ends lines on LF alone would read a
        # header the proxy never saw (Transfer-Encoding smuggled inside a value).
        raise BadRequest(400, "bare CR or LF, or NUL, in the request head")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[0].isupper() \
            or not parts[0].isascii():
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1") or not target.startswith("/"):
        raise BadRequest(400, "only origin-form HTTP/1.x requests are forwarded")
    if _CONTROL.search(target):
        raise BadRequest(400, "a control character in the request target")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header lines")
    headers: list[tuple[str, str]] = []
    lengths: set[str] = set()
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise BadRequest(400, "malformed header line")
        # A bare CR or LF ends a line for the upstream's parser, not for this one: passed
        # on, it would smuggle a header (a second Content-Length) past the proxy.
        if _CONTROL.search(value):
            raise BadRequest(400, "a control character (CR, LF, NUL, ...) in a header value")
        value = value.strip(" \t")
        headers.append((name, value))
        low = name.lower()
        if low == "content-length":
            lengths.add(value)
        elif low == "transfer-encoding":
            raise BadRequest(411, "chunked request bodies are not forwarded: send "
                                  "Content-Length")
    if len(lengths) > 1:
        raise BadRequest(400, "conflicting Content-Length headers")
    text = lengths.pop() if lengths else "0"
    if not text.isdigit() or not text.isascii() or len(text) > 18:
        raise BadRequest(400, f"bad Content-Length {text[:40]!r}")
    return method, target, headers, int(text)


def wants_continue(head: bytes, headers: Iterable[tuple[str, str]], length: int) -> bool:
    """Whether the client waits for ``100 Continue`` before its body (RFC 9110 10.1.1):
    an ``Expect: 100-continue`` from an HTTP/1.1 client (an HTTP/1.0 one's is ignored) with a
    body to come. Any other expectation is :class:`BadRequest` 417: the proxy cannot meet
    it, and dropping the (hop-by-hop) header silently would leave the client waiting for
    something that will never come. ``head``: the request head as parsed by
    :func:`parse_head`."""
    expected = {m.strip().lower() for k, v in headers if k.lower() == "expect"
                for m in v.split(",") if m.strip()}
    if expected - {"100-continue"}:
        raise BadRequest(417, "unsupported expectation: only 100-continue is known")
    return bool(expected) and length > 0 and not head.split(b"\r\n", 1)[0].endswith(b"/1.0")


def status_of(first: bytes) -> int | None:
    """The status code of an HTTP/1.x status line at the start of ``first``."""
    parts = first.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit():
        return int(parts[1])
    return None


def header_list(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Headers as a dict with lower-case names (the last of repeated names wins)."""
    return {k.lower(): v for k, v in headers}
