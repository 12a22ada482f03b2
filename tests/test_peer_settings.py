"""The settings an in-engine probe or tap reads on the engine's side
(:mod:`sidecar.adapters.peer_settings`): what `engine-args` and the shipped manifests write
is accepted as is; an unknown key, a wrong type, a value out of range or an endpoint off this
host is refused at start with every problem named."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sidecar.adapters.peer_settings import check_settings
from sidecar.adapters.vllm.engine_config import PROBE_KEYS, probe_transfer_config

WHERE = "kv-sidecar probe: kv_connector_extra_config"
ROOT = Path(__file__).resolve().parents[1]


def test_what_engine_args_writes_is_accepted_with_defaults_filled_in() -> None:
    extra = probe_transfer_config("ipc:///tmp/kvs.sock", 10, 4, 3, 1000, 10, 0)[
        "kv_connector_extra_config"]
    got = check_settings(extra, PROBE_KEYS, WHERE)
    assert got == {**extra, "pipe_hwm": 64, "capture_slots": None,
                   "fingerprint_capacity": None}


def test_the_shipped_kubernetes_probe_config_is_accepted() -> None:
    text = (ROOT / "deploy/kubernetes/base/deployment.yaml").read_text()
    line = next(ln for ln in text.splitlines() if "kv_connector_extra_config" in ln)
    config = json.loads(line.strip().removeprefix("- ").strip("'"))
    got = check_settings(config["kv_connector_extra_config"], PROBE_KEYS, WHERE)
    assert got["endpoint"] == "ipc:///run/kv-sidecar/probe.sock"


@pytest.mark.parametrize(("extra", "says"), [
    ({"endpoint": "ipc:///tmp/k.sock", "sample_every": 0}, "sample_every must be an integer"),
    ({"endpoint": "ipc:///tmp/k.sock", "sample-every": 10}, "unknown key 'sample-every'"),
    ({"endpoint": "ipc:///tmp/k.sock", "pipe_hwm": "64"}, "pipe_hwm must be"),
    ({"endpoint": "ipc:///tmp/k.sock", "seed": 2.0}, "seed must be an integer"),
    ({"endpoint": "ipc:///tmp/k.sock", "fingerprint_every": -1}, "fingerprint_every must be"),
    ({"endpoint": "ipc:///tmp/k.sock", "capture_slots": math.inf}, "capture_slots must be"),
    ({"endpoint": "ipc:///tmp/k.sock", "blocks_per_sample": False}, "blocks_per_sample"),
    ({"endpoint": "tcp://0.0.0.0:5555"}, "only to a sidecar on this host"),
    ({"endpoint": "tcp://192.168.1.9:5555"}, "only to a sidecar on this host"),
    ({"sample_every": 10}, "'endpoint' must be a string"),
    ({"endpoint": None}, "'endpoint' must be a string"),
    ({"endpoint": "ipc:///tmp/" + "a" * 200}, "a unix socket's path holds at most 107"),
])
def test_a_bad_setting_is_refused_by_name(extra: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=WHERE) as err:
        check_settings(extra, PROBE_KEYS, WHERE)
    assert says in str(err.value)


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ValueError) as err:
        check_settings({"endpoint": "tcp://10.1.1.1:1", "x": 1, "seed": -5}, PROBE_KEYS, WHERE)
    msg = str(err.value)
    assert "unknown key 'x'" in msg and "seed must be" in msg and "on this host" in msg
    # a missing endpoint is one of the problems, not the only one named (found from outside)
    with pytest.raises(ValueError) as err:
        check_settings({"x": 1, "seed": -5}, PROBE_KEYS, WHERE)
    msg = str(err.value)
    assert "unknown key 'x'" in msg and "seed must be" in msg and "'endpoint' must be" in msg


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5;10.0.0.1:5",  # ZMQ: from 127.0.0.1:5 to 10.0.0.1:5
    "tcp://127.0.0.1:", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:5 ",
    "tcp://127.0.0.1:+5", "tcp://127.0.0.1:\u0665", "tcp://127.0.0.1:5555/x",
    "tcp://127.0.0.1.evil.com:5", "tcp://localhost:5", "TCP://127.0.0.1:5",
    "ipc://", "ipc://tmp/relative.sock", "ipc:///tmp/a;b", "ipc:///tmp/a\x00b",
    "ipc:///tmp/a\nb", "inproc://x",
])
def test_an_endpoint_is_loopback_tcp_or_an_absolute_ipc_path_and_nothing_else(
        endpoint: str) -> None:
    """Found from outside: a prefix test passed `tcp://127.0.0.1:5;10.0.0.1:5`, which ZMQ
    connects to 10.0.0.1, and ports ZMQ itself refuses later; both the in-engine check and the
    sidecar's bind check now read the whole endpoint."""
    from sidecar.adapters.vllm.endpoints import check_endpoint, check_peer_endpoint

    with pytest.raises(ValueError):
        check_peer_endpoint(endpoint)
    with pytest.raises(ValueError):
        check_endpoint(endpoint)
    check_peer_endpoint("tcp://127.0.0.1:65535")
    check_peer_endpoint("ipc:///run/kv-sidecar/probe.sock")


def test_settings_text_refuses_a_key_twice_deep_nesting_and_echoes_little() -> None:
    from sidecar.adapters.peer_settings import parse_settings

    with pytest.raises(ValueError, match="given twice"):
        parse_settings('{"endpoint": "ipc:///tmp/a", "seed": 1, "seed": 2}', "X")
    with pytest.raises(ValueError, match="X is not JSON"):
        parse_settings("[" * 100_000, "X")
    long_key = "k" * 100_000
    with pytest.raises(ValueError) as err:
        check_settings({"endpoint": "ipc:///tmp/a", long_key: 1}, PROBE_KEYS, WHERE)
    assert len(str(err.value)) < 400


def test_engine_args_refuse_what_the_engine_would_refuse(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`engine-args` checks what it prints against the table the engine side checks: it
    printed settings the tap then refused (`--sample-every 0`, a remote endpoint)."""
    pytest.importorskip("zmq")
    from sidecar.cli.main import main

    assert main(["sglang", "engine-args", "--probe", "tcp://10.0.0.1:5",
                 "--sample-every", "0"]) == 2
    err = capsys.readouterr().err
    assert "on this host" in err and "sample_every" in err
    assert main(["vllm", "engine-args", "--probe", "tcp://127.0.0.1:5;10.0.0.1:5"]) == 2
    assert "on this host" in capsys.readouterr().err
