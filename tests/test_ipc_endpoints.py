"""The ipc sockets the sidecar binds (the probe/tap receiver, a bound KV-event subscriber):
ZMQ removes whatever is at an ``ipc://`` path it binds and leaves its socket file behind
when it closes. The sidecar refuses a path that holds anything but a stale socket (a
mistyped ``--probe`` deleted the file there; a live socket would be taken over), and
removes the socket file it bound when it stops (outside check: one was left in /tmp per
run), unless another bind has replaced it since."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from sidecar.adapters.vllm.audit import EventAuditor
from sidecar.adapters.vllm.endpoints import check_endpoint
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.subscriber import EventSubscriber
from sidecar.export.metrics import Metrics


def _receiver(path: Path) -> ProbeReceiver:
    return ProbeReceiver(f"ipc://{path}", Metrics("vllm", "tiny"), lambda _: None,
                         lambda _: None, ipc_dirs=(str(path.parent),))


def test_a_path_holding_a_file_or_a_live_socket_is_refused_and_left_alone(
        tmp_path: Path) -> None:
    kept = tmp_path / "notes.json"
    kept.write_text("{}")
    with pytest.raises(ValueError, match="not a socket"):
        check_endpoint(f"ipc://{kept}", (str(tmp_path),))
    with pytest.raises(ValueError, match="not a socket"):
        _receiver(kept)
    assert kept.read_text() == "{}"
    (tmp_path / "dir.sock").mkdir()
    with pytest.raises(ValueError, match="not a socket"):
        check_endpoint(f"ipc://{tmp_path}/dir.sock", (str(tmp_path),))

    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(live))
        listener.listen(1)
        with pytest.raises(ValueError, match="in use"):
            _receiver(live)
        first = _receiver(tmp_path / "rx.sock").start()  # a live sidecar, too
        try:
            with pytest.raises(ValueError, match="in use"):
                _receiver(tmp_path / "rx.sock")
        finally:
            first.stop()
    assert live.is_socket()  # closed, nobody listens: a stale socket from here on
    rx = _receiver(live).start()
    rx.stop()
    assert not live.exists()


def test_the_receiver_removes_the_socket_file_it_bound_and_no_other(tmp_path: Path) -> None:
    path = tmp_path / "r.sock"
    for replaced in (False, True):
        rx = _receiver(path).start()
        assert path.is_socket()
        if replaced:
            path.unlink()
            path.write_text("another sidecar's")
        rx.stop()
        assert path.exists() is replaced
    assert path.read_text() == "another sidecar's"


def test_a_bound_event_subscriber_removes_its_socket_file(tmp_path: Path) -> None:
    path = tmp_path / "events.sock"
    sub = EventSubscriber(EventAuditor(Metrics("vllm", "tiny")), f"ipc://{path}", bind=True)
    sub.start()
    deadline = time.monotonic() + 30  # bounds a hang only
    while not path.is_socket():
        assert time.monotonic() < deadline, "the subscriber never bound"
        time.sleep(0.02)
    sub.stop()
    assert not path.exists()


@pytest.mark.parametrize("kind", [socket.SOCK_DGRAM, socket.SOCK_SEQPACKET])
def test_a_datagram_or_seqpacket_socket_in_use_is_refused_too(tmp_path: Path, kind) -> None:
    """A stream connect to those fails with EPROTOTYPE, not ECONNREFUSED: not stale (an
    outside check saw the other process's socket replaced)."""
    path = tmp_path / "other.sock"
    with socket.socket(socket.AF_UNIX, kind) as other:
        other.bind(str(path))
        if kind == socket.SOCK_SEQPACKET:
            other.listen(1)
        with pytest.raises(ValueError, match="in use"):
            _receiver(path)
        assert path.is_socket()


def test_a_path_a_bind_cannot_make_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        _receiver(tmp_path / "missing" / "p.sock")
    with pytest.raises(ValueError, match="at most 107"):
        check_endpoint(f"ipc://{tmp_path}/{'x' * 120}.sock", (str(tmp_path),))
    # the KV event socket is named as such
    with pytest.raises(ValueError, match="KV event socket"):
        EventSubscriber(EventAuditor(Metrics("vllm", "tiny")), "ipc:///etc/kv.sock", bind=True)


def test_vllm_serve_refuses_one_path_for_the_probe_and_the_bound_events(
        tmp_path: Path) -> None:
    from sidecar.adapters.vllm.service import VllmSidecar, VllmSidecarConfig

    for probe, events in ((f"ipc://{tmp_path}/s.sock", f"ipc://{tmp_path}/./s.sock"),
                          ("tcp://127.0.0.1:5999", "tcp://127.0.0.1:5999")):
        with pytest.raises(ValueError, match="--probe's socket too"):
            VllmSidecar(VllmSidecarConfig(model_dir=str(tmp_path), dtype="float32",
                                          block_size=16, probe_endpoint=probe,
                                          events_endpoint=events, events_bind=True))


def test_a_serve_command_whose_socket_cannot_be_bound_says_so_in_one_line(
        tmp_path: Path, capsys) -> None:
    """What passes the checks can still fail to bind (a tcp port another process holds):
    the serve commands print one line and exit 1, not a traceback."""
    from sidecar.cli.arg_types import started

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        rx = ProbeReceiver(f"tcp://127.0.0.1:{holder.getsockname()[1]}",
                           Metrics("vllm", "tiny"), lambda _: None, lambda _: None)
        assert not started(rx, "kv-sidecar vllm serve")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kv-sidecar vllm serve: error: cannot bind")
    assert not rx.alive


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_serve_commands_http_port_in_use_is_one_line_and_its_socket_removed(
        tmp_path: Path, capsys, engine: str) -> None:
    """Found from outside: the probe socket bound, the HTTP port held by another process
    gave a traceback (and left the socket file behind); now one line naming the address and
    --port 0, exit 1, the sidecar stopped. A port out of range is a usage error (exit 2)."""
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    from sidecar.cli.main import main

    model = write_tiny_llama(tmp_path / "model")
    sock = tmp_path / "p.sock"
    args = [engine, "serve", "--model", str(model), "--dtype", "float32", "--probe",
            f"ipc://{sock}", "--duration", "0.1", "--reference", "none"]
    if engine == "vllm":
        args += ["--block-size", "16"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        capsys.readouterr()
        rc = main([*args, "--port", str(port)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0] == (f"kv-sidecar {engine} serve: error: port {port} on 127.0.0.1 is in use "
                      "(another sidecar or demo?): pass --port 0 for any free port, or "
                      "another port")
    assert not sock.exists()  # the probe socket the sidecar had bound is gone
    with pytest.raises(SystemExit) as out:
        main([*args, "--port", "65536"])
    assert out.value.code == 2 and "65536" in capsys.readouterr().err
