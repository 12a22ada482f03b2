"""Checks where the KV lives: the device digest, the capture buffer, ``--device``.

No GPU here (nor in CI): what the CUDA path runs is exercised on CPU tensors (the same torch
ops, the same verdicts) and, for the capture buffer's slot accounting, on "meta" tensors.
``scripts/check-gpu.sh`` runs the CUDA branch itself on a GPU box.
"""

from __future__ import annotations

import gc

import pytest
import torch
from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from prometheus_client import CollectorRegistry

from sidecar import signals as S
from sidecar.checks.content import check_content
from sidecar.checks.device_digest import device_digest
from sidecar.checks.fingerprint import (
    DEFAULT_ALGORITHM,
    check_fingerprint,
    default_algorithm,
    kv_digest,
)
from sidecar.checks.recompute import block_error
from sidecar.checks.structure import check_structure
from sidecar.cli.main import main
from sidecar.core.capture_buffer import CaptureBuffer
from sidecar.core.device import DeviceUnavailable, resolve_device
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef, CacheGroup, EngineInfo, GroupKind
from sidecar.signals import AnomalyKind
from tests.limits import DETECTION_TIMEOUT_S
from tests.test_capture_epochs import ServedThenRepaired

REF = BlockRef(group_id=0, index=1, block_id=7)
SHAPE = (2, 2, 16, 8)


def _info(dtype: torch.dtype) -> EngineInfo:
    return EngineInfo("t", "m", "r1", str(dtype).removeprefix("torch."), 16, 2, 8,
                      (CacheGroup(0, GroupKind.FULL_ATTENTION, (0, 1)),))


def _block(dtype: torch.dtype, seed: int = 0) -> BlockKV:
    g = torch.Generator().manual_seed(seed)
    return BlockKV(REF, torch.randn(SHAPE, generator=g).to(dtype),
                   torch.randn(SHAPE, generator=g).to(dtype))


def _corruptions(dtype: torch.dtype) -> dict[str, BlockKV]:
    """The core faults' damage to one block, each on a fresh copy."""
    out = {"clean": _block(dtype)}
    b = _block(dtype)
    b.value.view(torch.int16 if dtype != torch.float32 else torch.int32)[1, 0, 3, 5] ^= 1
    out["low-bit"] = b
    b = _block(dtype)
    b.key.zero_()
    out["zeros"] = b
    b = _block(dtype)
    b.key[0, 1, 4, 2] = float("nan")
    out["nan"] = b
    b = _block(dtype)
    b.value[:] = b.value[:, :, :1]
    out["degenerate"] = b
    b = _block(dtype)
    b.key[:, :, [2, 9]] = b.key[:, :, [9, 2]]  # two tokens swapped
    out["swap"] = b
    b = _block(dtype, seed=1)  # another prefix's KV
    out["other"] = b
    return out


def _verdict(findings: list) -> set[AnomalyKind]:
    return {f.kind for f in findings}


def _through_capture(block: BlockKV) -> BlockKV:
    """The block as the CUDA path hands it to the checks: copied into a preallocated
    capture slot (the same buffer code; on CUDA the copy runs on the side stream)."""
    buf = CaptureBuffer(SHAPE, block.key.dtype, "cpu", slots=2)
    copies = buf.capture([(block.key, block.value)])
    assert copies is not None
    (key, value), = copies
    return BlockKV(block.ref, key, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_check_gives_the_same_verdict_on_the_device_path(dtype: torch.dtype) -> None:
    """Content, fingerprint, recompute and structure: host digest vs the device digest, a
    block in place vs the same block through the capture buffer (and, for structure, on
    "meta"): identical verdicts on every fault."""
    clean = _block(dtype)
    host_digest = kv_digest(clean.key, clean.value, DEFAULT_ALGORITHM)
    dev_digest = kv_digest(clean.key, clean.value, "wsum64")
    tol = 0.05 if dtype != torch.float32 else 1e-4
    flagged = set()
    for name, b in _corruptions(dtype).items():
        c = _through_capture(b)
        assert _verdict(check_content(b)) == _verdict(check_content(c)), name
        host = _verdict(check_fingerprint(b, host_digest))
        assert host == _verdict(check_fingerprint(c, dev_digest)), name
        assert host == _verdict(check_fingerprint(b, dev_digest)), name
        assert (block_error(b, clean) > tol) == (block_error(c, clean) > tol), name
        meta = BlockKV(b.ref, b.key.to("meta"), b.value.to("meta"))
        assert (_verdict(check_structure(b, _info(dtype), 2))
                == _verdict(check_structure(c, _info(dtype), 2))
                == _verdict(check_structure(meta, _info(dtype), 2))), name
        if host:
            flagged.add(name)
    assert flagged == set(_corruptions(dtype)) - {"clean"}  # the fingerprint sees them all


def test_device_digest_sees_every_single_word_change() -> None:
    key, value = _block(torch.float16).key, _block(torch.float16, 2).value
    base = device_digest(key, value)
    words = key.view(-1).view(torch.int32)
    for i in range(words.numel()):  # every word, every bit position in turn
        k = key.clone()
        k.view(-1).view(torch.int32)[i] ^= 1 << (i % 32)
        assert device_digest(k, value) != base, i
    assert device_digest(value, key) != base  # K and V swapped
    assert device_digest(key[..., :7].contiguous(), value) != base  # odd byte count pads


def test_device_digest_is_the_exact_modular_sum_torch_int64_must_give() -> None:
    """torch's int64 multiply and sum wrap modulo 2**64 (as on CUDA): the digest equals the
    same weighted sum in Python's exact integers, so no device can differ."""
    from sidecar.checks import device_digest as dd

    mask = (1 << 64) - 1
    cols = [w & mask for w in dd._odd_weights(1, 0, dd.COLUMNS)]

    def exact(t: torch.Tensor, row0: int) -> tuple[int, int]:
        b = bytes(t.contiguous().view(-1).view(torch.uint8).tolist())
        b += bytes((-len(b)) % (8 * dd.COLUMNS))
        words = [int.from_bytes(b[i:i + 8], "little") for i in range(0, len(b), 8)]
        n = len(words) // dd.COLUMNS
        rows = [w & mask for w in dd._odd_weights(2, row0, n)]
        return sum(rows[r] * sum(x * c for x, c in zip(words[r * dd.COLUMNS:],
                                                        cols, strict=False))
                   for r in range(n)) & mask, n

    b = _block(torch.bfloat16, 5)
    sk, nk = exact(b.key, 0)
    sv, _ = exact(b.value, nk)
    size = b.key.numel() * 2
    want = (sk + sv + dd._splitmix64(size) + 3 * dd._splitmix64(size + (1 << 50))) & mask
    assert device_digest(b.key, b.value) == f"{want:016x}"


def test_digest_defaults_to_the_device_algorithm_off_the_host() -> None:
    assert default_algorithm(torch.zeros(1)) == DEFAULT_ALGORITHM
    assert default_algorithm(torch.zeros(1, device="meta")) == "wsum64"
    with pytest.raises(ValueError, match="wsum64"):
        kv_digest(torch.zeros(1), torch.zeros(1), "md5-ish")


def test_capture_buffer_is_bounded_and_slots_come_back_when_the_sample_goes() -> None:
    buf = CaptureBuffer((2, 4, 16, 64), torch.bfloat16, "meta", slots=3)
    src = torch.empty((2, 4, 16, 64), dtype=torch.bfloat16, device="meta")
    first = buf.capture([(src, src), (src, src)])
    assert first is not None and buf.free_slots == 1
    assert first[0][0].device.type == "meta" and first[0][0].shape == src.shape
    assert buf.capture([(src, src), (src, src)]) is None  # refused, nothing taken
    assert buf.refused == 1 and buf.free_slots == 1
    del first
    gc.collect()
    assert buf.free_slots == 3
    with pytest.raises(ValueError, match="shape"):
        buf.capture([(src[:1], src[:1])])


def _run(capture_slots: int, blocks_per_sample: int) -> tuple[Monitor, CaptureBuffer]:
    engine = ReferenceEngine(EngineConfig(num_blocks=256, kv_digest=True, device="cpu"))
    engine.fault = ServedThenRepaired()
    adapter = ReferenceAdapter(engine, capture_slots=capture_slots)
    assert adapter.capture_buffer is not None
    mon = Monitor(adapter, SidecarConfig(sample_every=1, recompute_tokens_per_s=0,
                                         queue_size=10_000, blocks_per_sample=blocks_per_sample,
                                         adapter_timeout_s=DETECTION_TIMEOUT_S,
                                         allocator_check_min_interval_s=-1),
                  registry=CollectorRegistry())
    engine.sink = mon
    mon.start()
    drive(engine, ChatWorkload(WorkloadConfig(conversations=8, max_turns=4, seed=3)),
          max_requests=30)
    assert mon.drain(timeout_s=300)
    mon.stop()
    return mon, adapter.capture_buffer


def test_the_served_bytes_are_verified_from_the_capture_buffer() -> None:
    """A block zeroed while served and repaired right after: only a capture at match time
    sees it. Through the preallocated buffer, every slot is back once the verifier is done."""
    mon, buf = _run(capture_slots=64, blocks_per_sample=2)
    kinds = mon.metrics.by_label(S.ANOMALIES.name, "kind")
    assert kinds.get(AnomalyKind.ZEROS.value, 0) > 0, kinds
    assert buf.captured > 0 and buf.refused == 0
    gc.collect()
    assert buf.free_slots == buf.num_slots


def test_a_full_capture_buffer_refuses_and_the_sample_is_still_verified() -> None:
    mon, buf = _run(capture_slots=1, blocks_per_sample=4)
    assert buf.refused > 0
    assert mon.metrics.value_sum(S.VERIFIED.name) > 0


def test_cuda_without_a_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        ReferenceEngine(EngineConfig(device="cuda"))
    with pytest.raises(DeviceUnavailable, match="unsupported device"):
        resolve_device("xpu")
    assert main(["demo", "--device", "cuda", "--requests", "1", "--quiet"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_device_check_measures_on_cpu_and_refuses_a_missing_gpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/check-gpu.sh's module, on tiny blocks on the host (the CUDA run is the
    script's): every row measured, the capture copies what it was given, the table prints."""
    from kvtestbed.bench import gpu_check

    cpu = torch.device("cpu")
    rows = gpu_check.check_throughput(cpu, 2, (2, 2, 16, 8), 0.0)
    assert {(r["what"], r["blocks_per_call"]) for r in rows} == {
        (w, n) for w in ("device copy", "content stats", "digest (wsum64)",
                         "recompute compare") for n in (1, 2)}
    assert all(r["GB_per_s"] > 0 for r in rows)
    cap = gpu_check.capture_cost(cpu, (2, 2, 16, 8), 2, 2)
    assert cap["refused"] == 0 and cap["device_us_per_block"] is None
    table = gpu_check.format_table({
        "device": "cpu", "torch": torch.__version__, "throughput": rows, "capture": cap,
        "hooks": {"requests": 1, "sample_every": 1, "detached_req_per_s": 2.0,
                  "attached_req_per_s": 1.0, "slowdown": 2.0},
        "detection": [{"fault": "zero-block", "verified": 3, "anomalies": {"zeros": 2},
                       "ok": True}],
        "target": {"x_device_copy": 0.5, "met": False}})
    assert "zeros=2" in table and "slowdown 2.00x" in table and "NOT met" in table
    if not torch.cuda.is_available():
        assert gpu_check.main(["--device", "cuda"]) == 3
        assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("kv_storage", [None, "int8"])
def test_model_and_pool_keep_every_tensor_on_their_device(kv_storage: str | None) -> None:
    """What ``--device cuda`` runs, on "meta": any tensor left on the host (a weight, the
    rotary buffer, token ids, an index, an adapter bias) fails the op that mixes them."""
    from kvtestbed.engines.model import ModelConfig, TinyLlama
    from kvtestbed.engines.pool import BlockPool

    model = TinyLlama(ModelConfig(dtype="bfloat16"), device="meta")
    assert {t.device.type for t in [*model.model.parameters(), *model.model.buffers()]} \
        == {"meta"}
    first = model.forward([1, 2, 3, 4, 5, 6], adapter="tenant-lora")
    later = model.forward([7, 8], adapter="tenant-lora", past=first.kv)
    assert later.kv.keys.device.type == "meta" and later.last_logits.device.type == "meta"
    pool = BlockPool(8, 4, model.num_layers, 2, 16, torch.bfloat16, kv_storage=kv_storage,
                     device="meta")
    pool.write([1, 3], 0, first.kv.keys, first.kv.values)
    keys, _ = pool.gather([1, 3], 6)
    assert keys.device.type == "meta" and tuple(keys.shape) == tuple(first.kv.keys.shape)
    pool.import_block(5, pool.export_block(3))
    assert pool.read_block(5)[0].device.type == "meta"


def test_the_cuda_capture_is_ordered_after_the_write_and_before_the_engines_next_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch's stream protocol, with streams and events that log what they are
    asked (no CUDA here; the copies themselves run on CPU tensors): the side stream waits
    on an event recorded on the engine's stream, copies inside the side stream, and the
    engine's stream waits on the copy's event before anything it queues next."""
    log: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, event: Event) -> None:
            log.append(f"{self.name} waits {event.name}")

    class Event:
        made = 0

        def __init__(self) -> None:
            Event.made += 1
            self.name = ("written", "copied")[Event.made - 1]

        def record(self, stream: Stream) -> None:
            log.append(f"{self.name} recorded on {stream.name}")

    class StreamContext:
        def __init__(self, stream: Stream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            log.append(f"enter {self.stream.name}")

        def __exit__(self, *exc: object) -> None:
            log.append(f"exit {self.stream.name}")

    engine = Stream("engine")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: engine)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    buf = CaptureBuffer(SHAPE, torch.float32, "cpu", slots=2)
    buf._side = Stream("side")  # type: ignore[assignment]
    src = _block(torch.float32)
    real_copy = torch.Tensor.copy_

    def logged_copy(dst: torch.Tensor, s: torch.Tensor, non_blocking: bool = False):
        log.append(f"copy non_blocking={non_blocking}")
        return real_copy(dst, s, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)
    (key, value), = buf.capture([(src.key, src.value)]) or []
    assert log == ["written recorded on engine", "side waits written", "enter side",
                   "copy non_blocking=True", "copy non_blocking=True",
                   "copied recorded on side", "exit side", "engine waits copied"]
    assert torch.equal(key, src.key) and torch.equal(value, src.value)
