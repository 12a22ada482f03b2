"""Where an upstream's answer ends (sidecar/protect/framing.py): what decides whether the
guard's connection to the upstream may serve the next user, so it is tested on every way
the bytes can be split across reads."""

from __future__ import annotations

import random

import pytest

from sidecar.protect.framing import BadAnswer, ChunkedEnd, parse_answer_head

BODY = (b"5;ext=1\r\nhello\r\n"
        b"10\r\n" + b"x" * 16 + b"\r\n"
        b"0\r\nTrailer-A: 1\r\nTrailer-B: 2\r\n\r\n")


def _end(pieces: list[bytes]) -> int:
    """Where ``ChunkedEnd`` says the answer ended, as an offset into the joined pieces."""
    tracker, seen = ChunkedEnd(), 0
    for piece in pieces:
        end = tracker.feed(piece)
        if end >= 0:
            assert tracker.done
            return seen + end
        seen += len(piece)
    assert not tracker.done
    return -1


@pytest.mark.parametrize("seed", range(20))
def test_the_end_of_a_chunked_answer_is_found_however_the_reads_split_it(seed: int) -> None:
    rng = random.Random(seed)
    data = BODY + b"HTTP/1.1 200 OK\r\n"  # the next answer's bytes must not be counted
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 12)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert _end(pieces) == len(BODY)


def test_byte_by_byte_and_an_unfinished_stream() -> None:
    assert _end([bytes([b]) for b in BODY]) == len(BODY)
    assert _end([BODY[:-1]]) == -1  # the blank line after the trailers not yet there


@pytest.mark.parametrize("bad", [b"zz\r\n", b"-1\r\n", b"5\r\nhelloXX", b"1" * 5000,
                                 b"\r\n", b"1234567890abcdef0\r\n"])
def test_broken_chunk_framing_is_refused(bad: bytes) -> None:
    with pytest.raises(BadAnswer):
        ChunkedEnd().feed(bad)


@pytest.mark.parametrize(("head", "method", "length", "chunked", "reusable"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 12", "POST", 12, False, True),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", "POST", None, True, True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close", "POST", 12, False, False),
    (b"HTTP/1.0 200 OK\r\nContent-Length: 12", "POST", 12, False, False),
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain", "POST", None, False, False),  # to close
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3", "POST", None,
     False, False),  # both framings: trusted for neither, relayed to the close
    (b"HTTP/1.1 204 No Content", "POST", 0, False, True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 12", "HEAD", 0, False, True),
    (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x", "GET", None, False, False),
])
def test_answer_heads(head: bytes, method: str, length: int | None, chunked: bool,
                      reusable: bool) -> None:
    a = parse_answer_head(head, method)
    assert (a.length, a.chunked, a.reusable) == (length, chunked, reusable)
    assert a.head.endswith(b"\r\nConnection: close\r\n\r\n")
    assert a.head.lower().count(b"connection:") == 1


@pytest.mark.parametrize("head", [b"SMTP 220 hi", b"HTTP/1.1 2000 OK",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: -1",
                                  b"HTTP/1.1 200 OK\r\nno colon here"])
def test_answer_heads_the_relay_cannot_pass_on(head: bytes) -> None:
    with pytest.raises(BadAnswer):
        parse_answer_head(head, "POST")
