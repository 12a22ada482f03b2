"""The real-engine benches' clients (``kvtestbed.bench.perf_drive.drive``) against servers
that close keep-alive connections: a request that meets a connection the server had already
closed is sent once more on a new one and counted; a server that never answers ends the run
with one line naming the configuration and phase (a bench once died on a bare "Broken pipe"
under load, not saying which of its servers)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest
from kvtestbed.bench.perf_drive import drive, sglang_api

ANSWER = json.dumps({"meta_info": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()


def _serve(answer: bool) -> tuple[socket.socket, threading.Thread]:
    """A server that reads one request per connection, answers it as keep-alive (HTTP/1.1,
    no ``Connection: close``) if ``answer``, then closes the connection anyway."""
    listener = socket.create_server(("127.0.0.1", 0))

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next((h.split(b":")[1] for h in head.split(b"\r\n")
                                   if h.lower().startswith(b"content-length")), b"0"))
                while len(body) < length:
                    body += conn.recv(65536)
                if answer:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return listener, thread


@pytest.fixture
def closing_server() -> Iterator[str]:
    listener, _ = _serve(answer=True)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    listener, _ = _serve(answer=False)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def test_a_closed_keep_alive_connection_is_reopened_and_counted(closing_server: str) -> None:
    out = drive(closing_server, sglang_api(), [[1, 2, 3]] * 4, 1, 2, "on, round 1")
    assert out["requests"] == 4 and out["prompt_tokens"] == 12
    assert out["completion_tokens"] == 8
    assert out["reconnects"] == 3  # every request after the first met a closed connection


def test_a_server_that_never_answers_is_one_line_naming_the_run(silent_server: str) -> None:
    with pytest.raises(RuntimeError) as e:
        drive(silent_server, sglang_api(), [[1, 2, 3]] * 2, 1, 2, "off again, warm-up")
    msg = str(e.value)
    assert msg.startswith(f"off again, warm-up: {silent_server}: ") and "\n" not in msg
    assert "RemoteDisconnected" in msg or "closed" in msg or "reset" in msg.lower(), msg
