"""The device check behind ``scripts/check-gpu.sh``: the sidecar where the KV lives.

On a CUDA device (``--device cpu`` runs the same code on the host, for development and for
the test that keeps this module from rotting), side by side in one run:

* **check throughput**: content stats, the device digest (``wsum64``) and the recompute
  compare over realistic blocks, in GB/s of KV checked, next to a device-to-device copy of
  the same bytes (the memory-bandwidth limit; target: checks >= 0.5x of it), per block as
  the verifier calls them and 64 blocks per call;
* **capture cost** per sampled block: the bounded capture buffer's copy (host time to queue
  it, device time of the side-stream copy);
* **hook overhead**: the reference engine on the device serving the same workload with the
  sidecar attached vs detached (requests/s);
* **detection** of the core faults with the engine on the device: anomalies by kind, and no
  anomaly on the clean run.

Prints a table and, with ``--json``, one JSON object. Needs only PyTorch and transformers
(the reference engine's tiny model is initialised from a config: no downloads).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvtestbed.adapters.paged_adapter import ReferenceAdapter
from kvtestbed.engines.engine import EngineConfig, ReferenceEngine
from kvtestbed.engines.model import ModelConfig
from kvtestbed.workload import ChatWorkload, WorkloadConfig, drive
from sidecar.checks.content import check_content
from sidecar.checks.device_digest import device_digest
from sidecar.checks.recompute import block_error
from sidecar.core.capture_buffer import CaptureBuffer
from sidecar.core.device import DeviceUnavailable, resolve_device
from sidecar.core.monitor import Monitor, SidecarConfig
from sidecar.core.protocol import BlockKV, BlockRef

# An 8B-class bf16 block: 32 layers x 8 KV heads x 16 tokens x 128 (2 MiB of K and V).
BLOCK = (32, 8, 16, 128)
BATCH = 64  # blocks per call in the batched rows
CORE_FAULTS = ("zero-block", "nonfinite", "bit-flip", "stale-reuse", "torn-write",
               "boundary-off-by-one", "layout-mismatch", "hash-collision")
TARGET_RATIO = 0.5  # checks vs the device copy of the same bytes
FAULT_RATE = 0.5  # chance a fault acts where it can, from request 4 on (a short run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn: Callable[[], Any], device: torch.device,
                      min_time_s: float) -> float:
    fn()  # warm-up (allocator, kernels' first launch)
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if n >= 3 and time.perf_counter() - t0 >= min_time_s:
            break
    _sync(device)
    return (time.perf_counter() - t0) / n


def check_throughput(device: torch.device, blocks: int, shape: tuple[int, ...],
                     min_time_s: float) -> list[dict[str, Any]]:
    """GB/s of KV bytes per check and of a device copy of the same bytes, per block and
    ``blocks`` per call."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for per_call in (1, blocks):
        full = (per_call * shape[0], *shape[1:])
        key = torch.randn(full, generator=g, device=device).to(torch.bfloat16)
        value = torch.randn(full, generator=g, device=device).to(torch.bfloat16)
        rows += _throughput_rows(device, key, value, per_call, min_time_s)
    return rows


def _throughput_rows(device: torch.device, key: torch.Tensor, value: torch.Tensor,
                     per_call: int, min_time_s: float) -> list[dict[str, Any]]:
    ref = BlockRef(0, 0, 0)
    cached = BlockKV(ref, key, value)
    reference = BlockKV(ref, key * 1.001, value.clone())
    dst_k, dst_v = torch.empty_like(key), torch.empty_like(value)
    nbytes = 2 * key.numel() * key.element_size()

    def copy() -> None:
        dst_k.copy_(key)
        dst_v.copy_(value)

    timings = {
        "device copy": _seconds_per_call(copy, device, min_time_s),
        "content stats": _seconds_per_call(lambda: check_content(cached), device,
                                           min_time_s),
        "digest (wsum64)": _seconds_per_call(lambda: device_digest(key, value), device,
                                               min_time_s),
        "recompute compare": _seconds_per_call(lambda: block_error(cached, reference),
                                               device, min_time_s),
    }
    copy_gbs = nbytes / timings["device copy"] / 1e9
    return [{"what": name, "blocks_per_call": per_call, "MiB": nbytes / 2**20,
             "us_per_call": s * 1e6, "GB_per_s": nbytes / s / 1e9,
             "x_device_copy": nbytes / s / 1e9 / copy_gbs} for name, s in timings.items()]


def capture_cost(device: torch.device, shape: tuple[int, ...], sampled: int,
                 repeats: int) -> dict[str, Any]:
    """Per sampled block: host time to queue the capture, device time of the copy."""
    pool_k = torch.randn((shape[0], 64, *shape[1:]), device=device).to(torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    buf = CaptureBuffer(shape, torch.bfloat16, device, slots=sampled)
    blocks = [(pool_k[:, b], pool_v[:, b]) for b in range(sampled)]
    host, dev = [], []
    for _ in range(repeats):
        _sync(device)
        start = end = None
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        copies = buf.capture(blocks)
        host.append(time.perf_counter() - t0)
        if start is not None and end is not None:
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
        assert copies is not None and torch.equal(copies[-1][0], blocks[-1][0])
        del copies  # the slots come back with the views
    per = sampled
    return {"blocks_per_capture": sampled, "MiB_per_block": buf.slot_bytes / 2**20,
            "host_us_per_block": 1e6 * min(host) / per,
            "device_us_per_block": 1e6 * min(dev) / per if dev else None,
            "refused": buf.refused}


def _engine(device: str, fault: str, seed: int) -> ReferenceEngine:
    return ReferenceEngine(EngineConfig(model=ModelConfig(dtype="bfloat16", seed=seed),
                                        num_blocks=256, fault=fault, fault_seed=seed,
                                        fault_start_after=4, fault_probability=FAULT_RATE,
                                        kv_digest=True,
                                        device=device))


def _attach(engine: ReferenceEngine, sample_every: int) -> Monitor:
    mon = Monitor(ReferenceAdapter(engine, capture_slots=64),
                  SidecarConfig(sample_every=sample_every, recompute_tokens_per_s=0,
                                queue_size=10_000, allocator_check_min_interval_s=0.0),
                  registry=CollectorRegistry())
    engine.sink = mon
    return mon


def _workload(requests: int) -> ChatWorkload:
    return ChatWorkload(WorkloadConfig(conversations=max(4, requests // 5), max_turns=5,
                                       seed=7))


def hook_overhead(device: str, requests: int, sample_every: int) -> dict[str, Any]:
    """Requests/s of the same workload, detached then attached (same process, same run)."""
    out: dict[str, Any] = {"requests": requests, "sample_every": sample_every}
    for label in ("detached", "attached"):
        engine = _engine(device, "none", 0)
        mon = _attach(engine, sample_every) if label == "attached" else None
        if mon is not None:
            mon.start()
        t0 = time.perf_counter()
        drive(engine, _workload(requests), max_requests=requests)
        _sync(engine.device)
        out[f"{label}_req_per_s"] = requests / (time.perf_counter() - t0)
        if mon is not None:
            mon.drain(timeout_s=120)
            mon.stop()
    out["slowdown"] = out["detached_req_per_s"] / out["attached_req_per_s"]
    return out


def detection(device: str, requests: int, faults: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for fault in ("none", *faults):
        engine = _engine(device, fault, 1)
        mon = _attach(engine, 2)
        mon.start()
        drive(engine, _workload(requests), max_requests=requests)
        mon.drain(timeout_s=120)
        mon.stop()
        s = mon.summary()
        anomalies = {k: v for k, v in s["anomalies"].items() if v}
        caught = bool(anomalies) or bool(s.get("allocator_violations"))
        rows.append({"fault": fault, "verified": s["verified"], "anomalies": anomalies,
                     "ok": (not caught) if fault == "none" else caught})
    return rows


def run(device_name: str, quick: bool) -> dict[str, Any]:
    device = resolve_device(device_name)
    shape = (4, 8, 16, 128) if quick else BLOCK
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "throughput": check_throughput(device, 4 if quick else BATCH, shape,
                                       0.05 if quick else 0.5),
        "capture": capture_cost(device, shape, 4, 5 if quick else 50),
        "hooks": hook_overhead(str(device), 20 if quick else 200, 100),
        "detection": detection(str(device), 40 if quick else 150,
                               CORE_FAULTS[:2] if quick else CORE_FAULTS),
    }
    batched = [r for r in result["throughput"] if r["blocks_per_call"] > 1
               and r["what"] != "device copy"]
    result["target"] = {"x_device_copy": TARGET_RATIO,
                        "met": all(r["x_device_copy"] >= TARGET_RATIO for r in batched)}
    return result


def format_table(r: dict[str, Any]) -> str:
    lines = [f"kv-sidecar device check on {r['device']} (torch {r['torch']})", "",
             f"{'check throughput':<22}{'blocks/call':>12}{'MiB':>9}{'us/call':>11}"
             f"{'GB/s':>9}{'x copy':>8}"]
    for t in r["throughput"]:
        lines.append(f"{t['what']:<22}{t['blocks_per_call']:>12}{t['MiB']:>9.1f}"
                     f"{t['us_per_call']:>11.1f}{t['GB_per_s']:>9.1f}"
                     f"{t['x_device_copy']:>8.2f}")
    c = r["capture"]
    dev = f"{c['device_us_per_block']:.1f}" if c["device_us_per_block"] is not None else "-"
    h = r["hooks"]
    lines += ["", f"capture per sampled block ({c['MiB_per_block']:.1f} MiB): host "
              f"{c['host_us_per_block']:.1f} us to queue, device {dev} us",
              f"hook overhead (1 in {h['sample_every']} sampled, {h['requests']} requests): "
              f"{h['detached_req_per_s']:.1f} req/s detached, {h['attached_req_per_s']:.1f} "
              f"attached, slowdown {h['slowdown']:.2f}x", "",
              f"{'fault':<22}{'verified':>9}  {'ok':<4}anomalies"]
    for d in r["detection"]:
        kinds = ", ".join(f"{k}={v:g}" for k, v in sorted(d["anomalies"].items())) or "-"
        lines.append(f"{d['fault']:<22}{d['verified']:>9}  {'yes' if d['ok'] else 'NO':<4}"
                     f"{kinds}")
    lines += ["", f"target: batched checks >= {r['target']['x_device_copy']}x the device "
              f"copy: {'met' if r['target']['met'] else 'NOT met'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtestbed.bench.gpu_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds; the test's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    # Each caught fault is logged by the reporter; the table counts them instead.
    logging.getLogger("sidecar.core.report").setLevel(logging.ERROR)
    try:
        resolve_device(args.device)
    except DeviceUnavailable as exc:
        print(f"check-gpu: {exc}; nothing measured.", file=sys.stderr)
        return 3
    r = run(args.device, args.quick)
    print(json.dumps(r, indent=1, sort_keys=True) if args.json else format_table(r))
    ok = all(d["ok"] for d in r["detection"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
