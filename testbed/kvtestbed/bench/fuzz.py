"""Seeded mutation fuzzers for ``kv-sidecar bench reliability``: every decoder a peer or an
engine integration can reach (KV events, probe wire, hook objects, HTTP requests).

Each fuzzer starts from valid inputs, mutates them (byte flips, truncation, splices, and
structural swaps with a pool of hostile values: NaN, negatives, 2**64, deep nests, huge
strings, wrong types) and feeds them to the real entry point. A case *escapes* when an
exception leaves the entry point (before issue 12 that ended the subscriber thread or
reached the engine); it is *lost* when it was neither applied nor counted as rejected.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from sidecar import signals as S
from sidecar.export.metrics import Metrics


class IncTally:
    """Counts ``Metrics.inc`` calls per signal name by wrapping the instance's method:
    reading a counter back through the registry collects every family, ~1 ms a case."""

    def __init__(self, metrics: Metrics) -> None:
        self.counts: dict[str, float] = {}
        real = metrics.inc

        def inc(sig: Any, amount: float = 1.0, **labels: str) -> None:
            self.counts[sig.name] = self.counts.get(sig.name, 0.0) + amount
            real(sig, amount, **labels)

        metrics.inc = inc  # type: ignore[method-assign]

    def __getitem__(self, name: str) -> float:
        return self.counts.get(name, 0.0)


@dataclass
class FuzzResult:
    name: str
    tried: str
    cases: int = 0
    survived: int = 0  # the entry point returned normally
    escaped: int = 0  # an exception left the entry point
    lost: int = 0  # neither applied nor counted

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "tried": self.tried, "cases": self.cases,
                "survived": self.survived, "escaped": self.escaped, "lost": self.lost}


def _nest(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


def hostile_values(rng: random.Random) -> Any:
    pool: list[Callable[[], Any]] = [
        lambda: None, lambda: -1, lambda: 2**64, lambda: 2**63 - 1, lambda: float("nan"),
        lambda: float("inf"), lambda: True, lambda: "", lambda: "x" * rng.randint(1, 5000),
        lambda: b"\x00" * rng.randint(0, 64), lambda: {}, lambda: [], lambda: {"a": [1]},
        lambda: _nest(rng.choice((5, 50, 600, 1200))), lambda: [None] * rng.randint(1, 50),
        lambda: rng.randint(-2**70, 2**70), lambda: rng.random() * 1e300,
        lambda: [rng.randint(-5, 5) for _ in range(rng.randint(0, 40))],
    ]
    return rng.choice(pool)()


def mutate_obj(obj: Any, rng: random.Random, depth: int = 0) -> Any:
    """Swap, drop or add one field somewhere in a msgpack-able structure."""
    if isinstance(obj, dict) and obj and depth < 4:
        obj = dict(obj)
        key = rng.choice(list(obj))
        r = rng.random()
        if r < 0.5:
            obj[key] = hostile_values(rng)
        elif r < 0.65:
            del obj[key]
        elif r < 0.8:
            obj[hostile_values(rng) if rng.random() < 0.3 else f"k{rng.randint(0, 9)}"] = \
                hostile_values(rng)
        else:
            obj[key] = mutate_obj(obj[key], rng, depth + 1)
        return obj
    if isinstance(obj, list) and obj and depth < 4:
        obj = list(obj)
        i = rng.randrange(len(obj))
        r = rng.random()
        if r < 0.4:
            obj[i] = hostile_values(rng)
        elif r < 0.55:
            del obj[i]
        elif r < 0.7:
            obj.append(hostile_values(rng))
        else:
            obj[i] = mutate_obj(obj[i], rng, depth + 1)
        return obj
    return hostile_values(rng)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    r = rng.random()
    if r < 0.35 and b:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif r < 0.55:
        b = b[:rng.randint(0, len(b))]
    elif r < 0.75:
        at = rng.randint(0, len(b))
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    elif r < 0.9:
        b = bytearray(b"\x91" * rng.randint(10, 3000) + b"\xc0")  # deep arrays
    else:
        b = bytearray(rng.randbytes(rng.randint(0, 200)))
    return bytes(b)


def _structured_or_bytes(valid: Any, rng: random.Random) -> bytes:
    if rng.random() < 0.6:
        try:
            return bytes(msgpack.packb(mutate_obj(valid, rng), use_bin_type=True))
        except Exception:  # not encodable (e.g. an int past 64 bits): mutate the bytes
            pass
    return mutate_bytes(msgpack.packb(valid, use_bin_type=True), rng)


# ---------------------------------------------------------------- KV events
def _event_corpus(block_size: int = 4) -> list[Any]:
    from sidecar.adapters.vllm.hashing import external, hash_block, hash_function, none_hash

    fn, parent = hash_function("sha256"), none_hash("sha256", None)
    assert parent is not None
    tokens = list(range(block_size * 2))
    h0 = hash_block(fn, parent, tokens[:block_size], None)
    h1 = hash_block(fn, h0, tokens[block_size:], None)
    stored = {"type": "BlockStored", "block_hashes": [external(h0, True), external(h1, True)],
              "parent_block_hash": None, "token_ids": tokens, "block_size": block_size,
              "lora_id": None, "medium": "GPU", "lora_name": None,
              "extra_keys": [None, None], "group_idx": 0}
    full = dict(stored, block_hashes=[h0, h1], extra_keys=[["salt"], [["mm", 3]]])
    removed = {"type": "BlockRemoved", "block_hashes": [external(h0, True)], "medium": "GPU"}
    return [[1.0, [stored]], [1.0, [full, removed]], [1.0, [{"type": "AllBlocksCleared"}]],
            [1.0, [stored, removed], 0]]


def fuzz_events(n: int, seed: int = 0) -> FuzzResult:
    """Mutated ``(topic, seq, payload)`` messages into ``EventSubscriber.handle``."""
    from sidecar.adapters.vllm.audit import EventAuditor
    from sidecar.adapters.vllm.subscriber import EventSubscriber

    rng = random.Random(seed)
    auditor = EventAuditor(Metrics("fuzz", "events"), max_indexed=10_000)
    sub = EventSubscriber(auditor, "ipc:///unused")  # handle() only: no socket
    corpus = _event_corpus()
    res = FuzzResult("kv_events", "mutated vLLM KV event messages -> EventSubscriber.handle")
    tally = IncTally(auditor.metrics)
    for i in range(n):
        frames: list[bytes] = [b"", (i + 1).to_bytes(8, "big"),
                               _structured_or_bytes(rng.choice(corpus), rng)]
        if rng.random() < 0.05:
            frames = frames[:rng.randint(0, 3)] + [b"x"] * rng.randint(0, 2)
        elif rng.random() < 0.05:
            frames[1] = rng.randbytes(rng.choice((0, 7, 8, 9)))
        before = (sub.batches, tally[S.KV_EVENT_DECODE_ERRORS.name])
        res.cases += 1
        try:
            sub.handle(frames)
            res.survived += 1
        except Exception:
            res.escaped += 1
            continue
        after = (sub.batches, tally[S.KV_EVENT_DECODE_ERRORS.name])
        if after == before:
            res.lost += 1
    return res


# ---------------------------------------------------------------- probe wire
def _probe_corpus() -> list[dict[str, Any]]:
    from sidecar.adapters.vllm.wire import PROTOCOL_VERSION

    base = {"v": PROTOCOL_VERSION, "src": "sched", "dropped": 0}
    kv = [[0, 0, 5, "float32", [2, 1, 4, 2], bytes(64), bytes(64)],
          [0, 1, 6, "bfloat16", [2, 1, 4, 2], bytes(32), bytes(32)]]
    return [dict(base, kind="lookups", items=[[32, 16], [8, 0]]),
            dict(base, kind="capture", id="c1", role="hit", salt=None, tokens=list(range(8)),
                 query_tokens=9, hit_tokens=8, blocks={0: [5, 6]}, kv=kv),
            dict(base, kind="hello", vllm="0.0", model="m", dtype="float32", block_size=4,
                 kv_heads=1, head_dim=2, groups={0: [0, 1]})]


def fuzz_probe(n: int, seed: int = 0) -> FuzzResult:
    """Mutated probe messages into ``ProbeReceiver.handle`` (capture tensors included);
    each decoded capture is verified by a real Monitor (:mod:`kvtestbed.bench.probe_verify`)
    and must be accounted for there."""
    from kvtestbed.bench.probe_verify import CaptureVerifier
    from sidecar.adapters.vllm.receiver import ProbeReceiver

    rng = random.Random(seed)
    corpus = _probe_corpus()
    verifier = CaptureVerifier()
    rx = ProbeReceiver("ipc:///tmp/kvsidecar-fuzz-unused.sock", Metrics("fuzz", "probe"),
                       lambda _items: None, verifier)
    res = FuzzResult("probe_wire", "mutated probe messages (dtype, shape, bytes, counts) "
                                   "-> ProbeReceiver.handle -> a real verifier")
    for _ in range(n):
        data = _structured_or_bytes(rng.choice(corpus), rng)
        before = rx.messages + rx.bad_messages
        res.cases += 1
        try:
            rx.handle(data)
            res.survived += 1
        except Exception:
            res.escaped += 1
            continue
        if rx.messages + rx.bad_messages == before:
            res.lost += 1
    res.escaped += verifier.escaped
    res.lost += verifier.unaccounted
    v = verifier.figures()
    res.tried += (f" ({v['captures']} captures: {v['verified']:g} verified, "
                  f"{v['dropped']:g} dropped, {v['anomalies']:g} anomalies)")
    return res


# ---------------------------------------------------------------- hook objects
def hostile_hook_call(rng: random.Random, good: Any) -> tuple[str, tuple[Any, ...]]:
    """One hook call with hostile arguments; ``good`` is a valid Lookup to mutate."""
    from sidecar.core.protocol import Hit, Lookup, StoredBlock

    def v() -> Any:  # hostile on purpose: the hooks must take any object
        return hostile_values(rng) if rng.random() < 0.7 else rng.randint(0, 64)

    r = rng.random()
    if r < 0.45:
        hit = good.hit if rng.random() < 0.5 else Hit(v(), v(), v() if rng.random() < 0.5
                                                       else {0: v()}, v(), v())
        return "on_lookup", (rng.choice([Lookup(v(), v(), hit), Lookup(v(), v()), None,
                                         v(), Lookup(good.query_tokens, v(), hit)]),)
    if r < 0.65:
        return "on_store", (rng.choice([StoredBlock(v(), v(), v(), v(), v()), None, v()]),)
    if r < 0.8:
        return rng.choice(("on_free", "on_release", "on_allocate")), (v(), v(), v(), v())
    return "on_request_done", (rng.choice([float("nan"), None, -1.0, math.inf, v(), "1"]),)


def fuzz_hooks(monitor: Any, good: Any, n: int, seed: int = 0) -> FuzzResult:
    """Hostile objects into every Monitor hook; a lookup is lost if it was neither counted
    as a lookup nor as rejected input nor as a hook error."""
    rng = random.Random(seed)
    res = FuzzResult("hook_objects", "None/NaN/negative/absurd/wrong-typed hook arguments "
                                     "-> Monitor hooks")
    m = monitor.metrics

    def tally() -> float:
        # The sidecar's own state, read directly (the hot path updates cells in place,
        # not through Metrics.inc); cheap enough to read per case.
        return (m.value(S.LOOKUPS.name) + m.value_sum(S.HOOK_INPUT_REJECTED.name)
                + m.value_sum(S.HOOK_ERRORS.name) + monitor.requests_done)

    for _ in range(n):
        hook, args = hostile_hook_call(rng, good)
        fn = getattr(monitor, hook)
        arity = {"on_lookup": 1, "on_store": 1, "on_request_done": 1, "on_free": 2,
                 "on_release": 3, "on_allocate": 4}[hook]
        before = tally()
        res.cases += 1
        try:
            fn(*args[:arity])
            res.survived += 1
        except Exception:
            res.escaped += 1
            continue
        if hook in ("on_lookup", "on_request_done") and tally() == before:
            res.lost += 1
    return res


# ---------------------------------------------------------------- HTTP requests
_PATHS = ("/metrics", "/healthz", "/status", "/", "/status?x=1", "/%00", "/" + "a" * 70000,
          "/../etc/passwd", "*", "http://127.0.0.1/metrics")


def _http_request(rng: random.Random) -> bytes:
    method = rng.choice(("GET", "GET", "GET", "POST", "HEAD", "PUT", "BREW", "", "G\x00T"))
    path = rng.choice(_PATHS)
    version = rng.choice(("HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "", "HTTP/1.1\x00"))
    headers = ["Host: 127.0.0.1"]
    for _ in range(rng.randint(0, 6)):
        headers.append(rng.choice((
            "Authorization: Bearer " + rng.choice(("", "x", "t0ken", "\xff" * 3)),
            f"Content-Length: {rng.choice((-1, 0, 10**12, 5))}", "Connection: close",
            "X-" + "h" * rng.randint(1, 70000) + ": v", "NoColonHere", ": empty",
            "Transfer-Encoding: chunked")))
    if rng.random() < 0.05:
        headers += ["X-Many: 1"] * 150
    raw = f"{method} {path} {version}\r\n" + "\r\n".join(headers) + "\r\n\r\n"
    data = raw.encode("utf-8", "surrogateescape")
    return mutate_bytes(data, rng) if rng.random() < 0.3 else data


def _exchange(server: Any, request: bytes) -> bytes:
    """One connection through the real handler on a socketpair; the answer's first bytes."""
    ours, theirs = socket.socketpair()
    try:
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        theirs.settimeout(2.0)
        with contextlib.suppress(OSError):
            theirs.sendall(request[:150_000])
        theirs.shutdown(socket.SHUT_WR)
        ours.settimeout(1.0)
        try:
            _serve_one(server, ours)
        finally:
            ours.close()  # as the server would: then whatever was answered is readable
        try:
            return theirs.recv(16)
        except OSError:
            return b""
    finally:
        ours.close()
        theirs.close()


def _serve_one(server: Any, sock: socket.socket) -> None:
    """What the server does with one connection, on this thread: the reception's read and
    verdict (:func:`sidecar.export.http_reception.examine`), then the real handler."""
    from sidecar.export.http_reception import HEALTHZ, MORE, Connection, examine, healthz_answer

    conn = Connection(sock, ("127.0.0.1", 0), time.monotonic() + 1.0)
    verdict: str | bytes = MORE
    while verdict == MORE:
        try:
            chunk = sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            return  # incomplete at the end: the reception closes it at the deadline
        start = max(0, len(conn.data) - 3)
        conn.data += chunk
        verdict = examine(conn, start)
    if isinstance(verdict, bytes):
        sock.sendall(verdict)
    elif verdict == HEALTHZ:
        sock.sendall(healthz_answer(conn, server._healthz_response))
    else:
        server.httpd.RequestHandlerClass(conn, conn.address, server.httpd)


_PROBE = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def fuzz_http(server: Any, n: int, seed: int = 0) -> FuzzResult:
    """Malformed requests through the real handler on a socketpair (no thread, no port).
    Every case must be answered or closed without an exception (an HTTP/0.9-style request
    gets a body without a status line: that is http.server's protocol, not a loss); every
    100 cases a well-formed scrape must still get a 200, or the fuzz counts a loss."""
    rng = random.Random(seed)
    res = FuzzResult("http_requests", "malformed request lines, headers, paths, tokens "
                                      "-> SidecarServer handler")
    for i in range(n):
        res.cases += 1
        try:
            _exchange(server, _http_request(rng))
            res.survived += 1
        except Exception:
            res.escaped += 1
        if i % 100 == 99 and not _exchange(server, _PROBE).startswith(b"HTTP/1.1 200"):
            res.lost += 1
    return res
