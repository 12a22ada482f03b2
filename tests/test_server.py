"""The HTTP endpoints a scraper and an operator use."""

import json
import urllib.request

from sidecar import signals as S
from sidecar.export.server import SidecarServer
from tests.conftest import make_toy


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


def test_metrics_healthz_status_on_loopback():
    engine, _, mon = make_toy()
    engine.serve(list(range(8)))
    mon.poll_allocator()
    srv = SidecarServer(mon.metrics.registry, mon.summary, port=0).start()
    try:
        assert srv.url.startswith("http://127.0.0.1:")
        code, body = get(srv.url + "/metrics")
        assert code == 200
        for sig in S.core_signals():
            assert f"# HELP {sig.name} " in body, sig.name
        # Adapter-owned signals are registered by their adapter, not exported by every sidecar.
        for owned in S.ADAPTER_SIGNALS.values():
            for sig in owned:
                assert f"# HELP {sig.name} " not in body, sig.name
        assert 'kvsidecar_lookups_total{engine="toy",model="toy-model"} 1.0' in body
        assert get(srv.url + "/healthz") == (200, "ok\n")
        code, body = get(srv.url + "/status")
        assert json.loads(body)["lookups"] == 1
        try:
            urllib.request.urlopen(srv.url + "/nope", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 404
        else:
            raise AssertionError("expected 404")
    finally:
        srv.stop()


def test_a_port_in_use_is_named_with_the_way_out():
    """The CLI prints this error as its one line: it names the address and --port 0
    (``[Errno 98] Address already in use`` named neither); errno is kept for callers."""
    import errno
    import socket

    import pytest
    from prometheus_client import CollectorRegistry

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(OSError) as info:
            SidecarServer(CollectorRegistry(), dict, port=port)
    assert str(info.value) == (f"port {port} on 127.0.0.1 is in use (another sidecar or "
                               "demo?): pass --port 0 for any free port, or another port")
    assert info.value.errno == errno.EADDRINUSE
