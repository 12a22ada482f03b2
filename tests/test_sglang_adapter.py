"""The SGLang adapter's engine-independent parts, without SGLang: the tap's messages over the
real pipe into the sidecar service (a fake pool of plain tensors stands in for SGLang's
``MHATokenToKVPool``), and the slot-census invariants. The live server is tests/sglang."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sidecar.adapters.sglang.census import Census, check_census
from sidecar.adapters.sglang.key_values import key_fields
from sidecar.adapters.sglang.tap import PoolGroup, SglangTap
from sidecar.signals import InvariantKind as K

BS = 4


class FakePool:
    """SGLang's NHD layout: per layer (slots, kv_heads, head_dim)."""

    def __init__(self, slots: int, layers: int = 2, heads: int = 2, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.k_buffer = [torch.randn(slots + 1, heads, dim, generator=g) for _ in range(layers)]
        self.v_buffer = [torch.randn(slots + 1, heads, dim, generator=g) for _ in range(layers)]


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _wait(cond, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for ``cond``: the deadline only bounds a hang (a loaded machine is slow)."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_tap_messages_reach_the_monitor(sockdir: Path) -> None:
    from sidecar.adapters.vllm.receiver import ProbeReceiver
    from sidecar.adapters.vllm.wire import Capture
    from sidecar.export.metrics import Metrics

    got: dict[str, list] = {"lookups": [], "capture": [], "stores": [], "frees": [],
                            "census": []}
    order: list[str] = []  # message kinds as the sidecar received them

    def on(kind: str, item: Any, many: bool = False) -> None:
        order.append(kind)
        got[kind].extend(item) if many else got[kind].append(item)

    endpoint = f"ipc://{sockdir}/p.sock"
    rx = ProbeReceiver(endpoint, Metrics("sglang", "tiny"),
                       lambda items: on("lookups", items, many=True),
                       lambda cap: on("capture", cap), groups=[0],
                       handlers={k: (lambda m, k=k: on(k, m))
                                 for k in ("stores", "frees", "census")}).start()
    try:
        pool = FakePool(64)
        tap = SglangTap(endpoint, BS, sample_every=2, blocks_per_sample=2, census_every_s=0)
        tap.attach([PoolGroup.full(pool)], 64, "0.5.23", "tiny")
        tokens = list(range(10, 22))  # 3 blocks
        path = torch.arange(30, 42)
        tap.allocated(path)
        fields = key_fields("tenant-a", None)
        tap.inserted(tokens, path, 0, fields)
        tap.inserted(tokens, path, 8, fields)  # re-insert: only block 2 ends past 8
        for rid in ("a", "b"):
            tap.admitted(rid, tokens + [99], 10, path[:10], fields)
        tap.admitted("a", tokens, 10, path[:10], fields)  # second checkpoint: not a lookup
        free = torch.cat([torch.arange(1, 30), torch.arange(42, 65)])
        tap.census(free, path, evictable=12, protected=0, idle=True)
        tap.freed(torch.tensor([33, 34, 41]))  # 33 and 41 end blocks
        tap.cleared()  # a cache flush: the one block still stored (37) is freed
        # Wait before closing: the pipe closes with linger 0 (an engine never waits on its
        # way out), so on a loaded machine a close right away can drop what is still queued.
        _wait(lambda: len(got["census"]) == 1 and len(got["frees"]) == 1 and
              sum(len(m["items"]) for m in got["stores"]) == 4)
        tap.close()
    finally:
        rx.stop()
    stores = [item for m in got["stores"] for item in m["items"]]
    assert [(s[0], s[1], s[2]) for s in stores] == [
        (33, 0, tokens[0:4]), (37, 4, tokens[4:8]), (41, 8, tokens[8:12]),
        (41, 8, tokens[8:12])]
    assert stores[0][3] is None and stores[1][3] is not None
    assert stores[0][4] == {"extra_key": "tenant-a", "cache_salt": ""}
    assert len(got["lookups"]) + len(got["capture"]) == 2  # one per request, 1 in 2 sampled
    cap: Capture = got["capture"][0]
    assert cap.hit_tokens == 10 and cap.blocks == {0: [33, 37]}
    assert cap.key_fields == fields
    for (g, i), (k, v) in cap.kv.items():
        want = torch.stack([b[path[i * BS:(i + 1) * BS]] for b in pool.k_buffer]).transpose(1, 2)
        assert g == 0 and torch.equal(k, want) and v.shape == k.shape == (2, 2, BS, 8)
    # One message per run of a kind, in the order things happened: the two inserts' stores
    # in one message and request a's lookup ahead of the capture (request b) that names
    # their blocks, the census behind them, the free and the flush's free together.
    assert order == ["stores", "lookups", "capture", "census", "frees"], order
    assert [m["ids"] for m in got["frees"]] == [[33, 41, 37]]
    census = __import__("sidecar.adapters.sglang.census", fromlist=["x"]).decode_census(
        got["census"][0])
    assert census.total == 64 and int(census.free.sum()) == 52 and census.evictable == 12
    assert check_census(census) == []  # 30..41 handed out and in the tree, the rest free



def _census(free: list[int], tree: list[int], allocated: list[int], total: int = 16,
            free_len: int | None = None, evictable: int | None = None, protected: int = 0,
            idle: bool = False) -> Census:
    def bits(ids: list[int]) -> np.ndarray:
        b = np.zeros(total + 1, dtype=bool)
        b[ids] = True
        return b
    return Census(total, len(free) if free_len is None else free_len, bits(free), len(tree),
                  bits(tree), bits(allocated),
                  len(tree) - protected if evictable is None else evictable, protected, idle)


def test_the_last_release_ships_the_batched_lookups(sockdir: Path) -> None:
    """Lookups travel in batches; a server going quiet (its last request released) must not
    keep them back, where the hit-rate audit cannot count them."""
    from sidecar.adapters.vllm.receiver import ProbeReceiver
    from sidecar.export.metrics import Metrics

    got: list[tuple[int, int]] = []
    endpoint = f"ipc://{sockdir}/p.sock"
    rx = ProbeReceiver(endpoint, Metrics("sglang", "tiny"), got.extend, lambda cap: None,
                       groups=[0]).start()
    try:
        tap = SglangTap(endpoint, BS, sample_every=10**9, census_every_s=3600)
        tap.attach([PoolGroup.full(FakePool(64))], 64, "0.5.23", "tiny")
        path = torch.arange(30, 42)
        for rid in ("a", "b", "c"):
            tap.admitted(rid, list(range(12)), 8, path[:8], key_fields(None, None))
        tap.released("a")
        tap.released("b")
        time.sleep(0.3)  # a message sent now would have arrived: none was
        assert got == []
        tap.released("c")  # the last one out
        _wait(lambda: len(got) == 3, 60.0)
        assert len(got) == 3  # before close (which flushes too)
        tap.close()
    finally:
        rx.stop()
    assert [tuple(x) for x in got] == [(12, 8)] * 3


def test_census_clean_and_each_invariant_named() -> None:
    tree, private = list(range(1, 9)), [9, 10]
    free = list(range(11, 17))
    assert check_census(_census(free, tree, tree + private)) == []
    assert check_census(_census(free + private, tree, tree, idle=True)) == []  # 9, 10 back
    kinds = {v.kind for v in check_census(_census(free + [3], tree, tree + private))}
    assert K.FREE_WHILE_INDEXED in kinds  # slot 3 freed while the tree holds it
    assert {v.kind for v in check_census(_census(free, tree, tree + private,
                                                 free_len=len(free) + 1))} == {K.DOUBLE_FREE}
    assert K.FREE_WHILE_HELD in {v.kind for v in check_census(
        _census(free + [9], tree, tree + private))}
    assert {v.kind for v in check_census(_census(free, tree, tree + private, protected=-1,
                                                 evictable=9))} == {K.BLOCK_COUNT_MISMATCH}
    assert {v.kind for v in check_census(_census(free[1:], tree, tree + private))} == {
        K.BLOCK_COUNT_MISMATCH}  # slot 11 neither free nor handed out: lost
    assert {v.kind for v in check_census(_census(free, tree, tree + private, idle=True))} \
        == {K.LEAKED_REFERENCE}  # idle, yet 9 and 10 are held by nobody


def test_engine_args_name_the_backend_and_the_tap_config(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    import json
    import shlex

    from sidecar.cli.main import main

    assert main(["sglang", "engine-args", "--probe", "ipc:///tmp/kvs-x.sock",
                 "--sample-every", "10"]) == 0
    out = capsys.readouterr().out.splitlines()
    name, _, value = out[0].removeprefix("export ").partition("=")
    cfg = json.loads(shlex.split(value)[0])
    assert name == "KVSIDECAR_SGLANG_TAP"
    assert cfg["endpoint"] == "ipc:///tmp/kvs-x.sock" and cfg["sample_every"] == 10
    assert "--radix-cache-backend kv-sidecar" in out[1]


def test_tap_stats_move_the_counters_by_what_grew_per_tap() -> None:
    """Each tap reports cumulative counts; the sidecar adds what grew, per sender: errors
    from 0 (a restarted tap, its count went back, from 0 again), the time from the tap's
    first stats on and never faster than wall time (an outside check drove it to 438 years
    by lowering and raising one sender's count, and by rotating senders)."""
    from types import SimpleNamespace

    from sidecar import signals as S
    from sidecar.adapters.sglang.service import SglangSidecar
    from sidecar.adapters.vllm.wire import WireError
    from sidecar.export.metrics import Metrics

    m = Metrics("sglang", "tiny")
    m.register(S.SGLANG_SIGNALS)
    now = [100.0]
    sc = SimpleNamespace(metrics=m, _taps={}, tap_errors=0, tap_seconds=0.0,
                         _clock=lambda: now[0])

    def stats(src: str, errors: int, busy_ns: int, after_s: float = 0.0) -> None:
        now[0] += after_s
        SglangSidecar._on_tap_stats(sc, {"src": src, "errors": errors, "busy_ns": busy_ns})

    stats("a", 0, 2_000_000_000)  # the baseline: time before it is not credited
    stats("a", 1, 3_000_000_000, after_s=5.0)  # +1 s in 5 s of wall time
    stats("b", 2, 500_000_000)  # a second scheduler process: its baseline, its errors
    stats("a", 0, 250_000_000, after_s=1.0)  # tap a's counts went back: a new baseline
    stats("a", 0, 1_250_000_000, after_s=2.0)  # +1 s in 2 s
    assert sc.tap_seconds == pytest.approx(2.0)
    assert m.value(S.SGLANG_TAP_SECONDS.name) == pytest.approx(2.0)
    assert sc.tap_errors == 3 and m.value(S.HOOK_ERRORS.name, hook="sglang_tap") == 3
    # Not faster than wall time: a jump of a day after 2 s credits 2 s now, the rest as
    # wall time passes (a burst of queued stats is not lost, just spread).
    stats("a", 0, 1_250_000_000 + 86_400 * 10**9, after_s=2.0)
    assert sc.tap_seconds == pytest.approx(4.0)
    stats("a", 0, 1_250_000_000 + 86_400 * 10**9, after_s=3.0)
    assert sc.tap_seconds == pytest.approx(7.0)
    # Lowering and raising a count, or new senders, credit nothing at once.
    before = sc.tap_seconds
    for i in range(100):
        stats("a", 0, 0)
        stats("a", 0, 2**62 - 1)
        stats(f"rotated-{i}", 0, 2**62 - 1)
    assert sc.tap_seconds == pytest.approx(before)
    for bad in ({"errors": -1, "busy_ns": 0}, {"errors": 0, "busy_ns": 1.5},
                {"errors": True, "busy_ns": 0}, {"errors": 0}):
        with pytest.raises(WireError):
            SglangSidecar._on_tap_stats(sc, {"src": "a", **bad})
    assert sc.tap_seconds == pytest.approx(before)  # refused messages change nothing
    assert len(sc._taps) <= 64


@pytest.mark.parametrize(("raw", "says"), [
    ('{"endpoint": "ipc:///tmp/kvs.sock", "block_size": 0}', "block_size must be an integer"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "sample_evry": 10}', "unknown key 'sample_evry'"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "sample_every": 1.5}', "sample_every must be"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "census_every_s": NaN}', "census_every_s must be"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "census_share": 1.5}', "census_share must be"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "census_share": -0.1}', "census_share must be"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "pipe_hwm": true}', "pipe_hwm must be"),
    ('{"endpoint": "ipc:///tmp/kvs.sock", "seed": -1}', "seed must be"),
    ('{"endpoint": "tcp://10.0.0.7:5555"}', "must be ipc://<absolute path> or tcp://127.0.0.1"),
    ('{"endpoint": "ipc://"}', "must be ipc://<absolute path>"),
    ('{"endpoint": 5}', "'endpoint' must be a string"),
    ('{"endpoint": "ipc:///tmp/%s.sock"}' % ("a" * 200), "holds at most 107"),
    ('{"endpoint": "ipc:///tmp/kvs.sock",', "is not JSON"),
    ("[1, 2]", "a string 'endpoint'"),
])
def test_the_tap_config_is_checked_whole(monkeypatch: pytest.MonkeyPatch, raw: str,
                                         says: str) -> None:
    """KVSIDECAR_SGLANG_TAP is written by hand in SGLang's environment: each bad key or
    value stops the backend at start with a line naming it (block_size 0 used to raise on
    every insert inside SGLang, a misspelt key fell back to its default, and any endpoint
    was connected to, a remote one included)."""
    from sidecar.adapters.sglang.backend import CONFIG_ENV, tap_config

    monkeypatch.setenv(CONFIG_ENV, raw)
    with pytest.raises(ValueError, match=CONFIG_ENV) as err:  # every line names the variable
        tap_config()
    assert says in str(err.value)


def test_the_tap_config_fills_defaults_and_names_every_problem(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.adapters.sglang.backend import CONFIG_ENV, TAP_KEYS, tap_config

    # What tests/sglang/harness.py gives every real server it starts: a census at every
    # chance (census_every_s 0, census_share 0). Refused for a moment here, which would have
    # stopped them all.
    harness = {"endpoint": "ipc:///tmp/kvs-sgl-x/probe.sock", "block_size": 16,
               "sample_every": 1, "blocks_per_sample": 8, "seed": 0, "census_every_s": 0.0,
               "census_share": 0.0}
    monkeypatch.setenv(CONFIG_ENV, json.dumps(harness))
    assert tap_config() == {**harness, "pipe_hwm": 256}
    monkeypatch.setenv(CONFIG_ENV, '{"endpoint": "tcp://127.0.0.1:5555", "sample_every": 7}')
    cfg = tap_config()
    assert cfg == {"endpoint": "tcp://127.0.0.1:5555", "sample_every": 7,
                   **{k: d for k, (_, _, _, d) in TAP_KEYS.items() if k != "sample_every"}}
    monkeypatch.setenv(CONFIG_ENV, '{"endpoint": "ipc:///tmp/k.sock", "block_size": -2, '
                                   '"x": 1, "census_every_s": "1"}')
    with pytest.raises(ValueError) as err:
        tap_config()
    assert all(part in str(err.value) for part in ("unknown key 'x'", "block_size must be",
                                                   "census_every_s must be a number"))


def test_reference_none_asks_for_no_recompute(tmp_path: Path) -> None:
    """`serve --reference none` verifies without a recompute: the Monitor is told so, rather
    than asking for one per sampled hit and logging each refusal as an adapter error."""
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    from sidecar.adapters.sglang.service import SglangSidecar, SglangSidecarConfig

    model = str(write_tiny_llama(tmp_path / "model"))
    for reference, recompute in (("none", False), ("hf", True)):
        sc = SglangSidecar(SglangSidecarConfig(model, "float32", probe_endpoint=(
            f"ipc://{tmp_path}/{reference}.sock"), reference=reference))
        assert sc.monitor.config.recompute is recompute
        sc.receiver.stop()
