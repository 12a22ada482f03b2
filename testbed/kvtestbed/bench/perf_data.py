"""Data-path figures of ``kv-sidecar bench perf``: check throughput on realistic blocks
next to a torch ``clone``, a one-pass ``amax`` and a raw one-pass read of the same bytes
(xxh3-64 over the buffer: no float conversion, the memory-bandwidth floor a check can
approach; a float32 ``sum`` without ``xxhash``), and vLLM KV-event ingestion (decode +
audit) next to msgpack decoding alone."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from sidecar.checks.content import check_content
from sidecar.checks.fingerprint import kv_digest
from sidecar.checks.recompute import block_error
from sidecar.core.protocol import BlockKV, BlockRef

# name -> (layers, kv heads, tokens per block, head dim, dtype); the label's byte count is
# computed from the shape (K and V together), never written by hand.
BLOCKS: dict[str, tuple[int, int, int, int, torch.dtype]] = {
    "8B-class bf16 block (32 layers x 8 heads x 16 tokens x 128)":
        (32, 8, 16, 128, torch.bfloat16),
    "1B-class bf16 block (16 layers x 8 heads x 16 tokens x 64)":
        (16, 8, 16, 64, torch.bfloat16),
}


def block_label(name: str, nbytes: int) -> str:
    """``name`` with the bytes of K and V together, in MiB (e.g. ``2 MiB K+V``)."""
    return f"{name[:-1]}, {nbytes / 2**20:g} MiB K+V)"


def raw_read() -> tuple[str, Callable[[torch.Tensor, torch.Tensor], Any]]:
    """The physical-limit baseline: one read of the raw bytes doing as little as possible
    per byte. xxh3-64 over the buffer where ``xxhash`` is installed, else a float32 sum."""
    try:
        import xxhash
    except ImportError:
        return "float32 sum", lambda k, v: (torch.sum(k, dtype=torch.float32),
                                           torch.sum(v, dtype=torch.float32))
    from sidecar.checks.fingerprint import tensor_bytes

    h = xxhash.xxh3_64_intdigest
    return "xxh3-64 raw read", lambda k, v: (h(tensor_bytes(k)), h(tensor_bytes(v)))


def _best_s(fn: Callable[[], Any], repeats: int, min_time_s: float) -> list[float]:
    """Seconds per call, per repeat (each repeat runs the call for at least min_time_s)."""
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s:
                break
        out.append(elapsed / n)
    return out


def _block_timings(key: torch.Tensor, value: torch.Tensor, repeats: int,
                   min_time_s: float) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(1)
    ref = BlockRef(0, 0, 0)
    cached = BlockKV(ref, key, value)
    noise = 0.001 * torch.randn(key.shape, generator=g)
    reference = BlockKV(ref, (key.float() + noise).to(key.dtype), value.clone())
    _, read = raw_read()
    return {
        "raw read": _best_s(lambda: read(key, value), repeats, min_time_s),
        "clone": _best_s(lambda: (key.clone(), value.clone()), repeats, min_time_s),
        "amax": _best_s(lambda: (torch.amax(key), torch.amax(value)), repeats, min_time_s),
        "content stats": _best_s(lambda: check_content(cached), repeats, min_time_s),
        "digest": _best_s(lambda: kv_digest(key, value), repeats, min_time_s),
        "recompute compare": _best_s(lambda: block_error(cached, reference), repeats,
                                     min_time_s),
    }


def check_throughput(repeats: int = 5, min_time_s: float = 0.2) -> list[dict[str, Any]]:
    """GB/s of each check and of the two baselines, per block shape: bytes read (K and V;
    both blocks for the compare) per second."""
    rows = []
    for name, (layers, heads, tokens, dim, dtype) in BLOCKS.items():
        g = torch.Generator().manual_seed(0)
        key = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)
        value = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)
        nbytes = key.numel() * key.element_size() * 2
        timings = _block_timings(key, value, repeats, min_time_s)
        # The compare reads two blocks (cached and reference): its bytes are both.
        gbs = {k: [nbytes * (2 if k == "recompute compare" else 1) / s / 1e9 for s in v]
               for k, v in timings.items()}
        rows.append({"block": block_label(name, nbytes), "bytes": nbytes,
                     "raw_read": raw_read()[0],
                     "gb_per_s": {k: statistics.median(v) for k, v in gbs.items()},
                     "spread": {k: [min(v), max(v)] for k, v in gbs.items()}})
    return rows


# ---------------------------------------------------------------- vLLM event ingestion
def _event_messages(n_events: int, per_batch: int) -> tuple[list[list[bytes]], list[bytes]]:
    """vLLM-format KV event messages: 1-block BlockStored events chained 8 deep (hashes
    computed with vLLM's sha256 recipe so the audit verifies them), each block removed
    again 256 events later (balanced), ``per_batch`` events per message."""
    from sidecar.adapters.vllm.events import encode_batch
    from sidecar.adapters.vllm.hashing import external, hash_block, hash_function, none_hash

    fn = hash_function("sha256")
    root = none_hash("sha256", None)
    assert root is not None
    events: list[dict[str, Any]] = []
    parent: bytes | None = None
    live: list[Any] = []
    i = 0
    while len(events) < n_events:
        tokens = [(i * 31 + t) % 30000 for t in range(32)]
        full = hash_block(fn, parent if parent is not None else root, tokens, None)
        published = external(full, True)
        events.append({"type": "BlockStored", "block_hashes": [published],
                       "parent_block_hash": external(parent, True) if parent else None,
                       "token_ids": tokens, "block_size": 32, "lora_id": None,
                       "medium": "GPU", "lora_name": None, "extra_keys": None,
                       "group_idx": 0})
        live.append(published)
        parent = full if (i + 1) % 8 else None
        if len(live) > 256:
            events.append({"type": "BlockRemoved", "block_hashes": [live.pop(0)],
                           "medium": "GPU", "group_idx": 0})
        i += 1
    events = events[:n_events]
    messages = [encode_batch(s, [time.time(), events[j:j + per_batch], 0])
                for s, j in enumerate(range(0, len(events), per_batch))]
    return messages, [m[2] for m in messages]


def event_ingestion(n_events: int = 100_000, per_batch: int = 16,
                    repeats: int = 3) -> dict[str, Any]:
    """Events per second: decode + audit + index through the vLLM adapter, and msgpack
    decoding of the same payloads alone (the floor), on one thread."""
    try:
        import msgpack

        from sidecar.adapters.vllm.audit import EventAuditor
        from sidecar.adapters.vllm.events import decode_message
        from sidecar.export.metrics import Metrics
    except ImportError as exc:
        return {"error": f"needs the events extra (pip install 'kv-sidecar[events]'): {exc}"}
    messages, payloads = _event_messages(n_events, per_batch)
    ingest: list[float] = []
    floor: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p in payloads:
            msgpack.unpackb(p, raw=False, strict_map_key=False)
        floor.append(n_events / (time.perf_counter() - t0))
        auditor = EventAuditor(Metrics("vllm", "bench"), algo="sha256")
        t0 = time.perf_counter()
        for m in messages:
            auditor.apply(decode_message(m))
        ingest.append(n_events / (time.perf_counter() - t0))
    summary = auditor.summary()
    return {"events": n_events, "events_per_batch": per_batch,
            "ingest_events_per_s": statistics.median(ingest),
            "ingest_spread": [min(ingest), max(ingest)],
            "msgpack_events_per_s": statistics.median(floor),
            "msgpack_spread": [min(floor), max(floor)],
            "audit": summary}
