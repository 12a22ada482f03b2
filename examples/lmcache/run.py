"""kv-sidecar on a real LMCacheEngine (local CPU + local disk tiers), from ``pip install`` to
the signals on ``http://127.0.0.1:PORT/metrics``.

    PYTHONHASHSEED=0 python examples/lmcache/run.py --fault zero-disk-chunk

A tiny Llama (randomly initialised from a config: nothing is downloaded) plays the serving
engine; requests share a few prompt prefixes, so LMCache stores their chunks and serves them
back. The CPU tier is small: cold chunks are evicted and read back from the disk tier. With
``--fault`` one chunk file on disk is damaged between two requests, as a failing disk or a
bad copy would: LMCache still reports a full hit; the sidecar names the kind and the tier.
Prints the sidecar's view as JSON (and serves /metrics while ``--linger`` lasts).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # nothing leaves this machine

import torch

CHUNK = 16


def tiny_llama(dtype: torch.dtype) -> Any:
    """A 2-layer Llama with random weights, seeded: the same model every run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config).to(dtype).eval()


def cpu_connector(kv_shape: tuple[int, ...]) -> Any:
    """LMCache's MockGPUConnector with the two copies done on a CPU tensor: the request's KV
    as ``kvcaches=`` of shape (2, layers, tokens, kv_heads * head_dim)."""
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class CPUConnector(MockGPUConnector):  # type: ignore[misc]
        def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, s, e in zip(objs, starts, ends, strict=True):
                obj.tensor.copy_(kw["kvcaches"][:, :, s:e])

        def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, s, e in zip(objs, starts, ends, strict=True):
                kw["kvcaches"][:, :, s:e].copy_(obj.tensor)

    return CPUConnector(kv_shape)


def prefill(model: Any, tokens: list[int]) -> torch.Tensor:
    """The model's KV for ``tokens`` in the connector's layout."""
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), use_cache=True)
    sides = []
    for side in ("keys", "values"):
        per_layer = [getattr(layer, side)[0] for layer in out.past_key_values.layers]
        t = torch.stack(per_layer)  # (layers, heads, tokens, head_dim)
        sides.append(t.permute(0, 2, 1, 3).reshape(t.shape[0], t.shape[2], -1))
    return torch.stack(sides)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--sample-every", type=int, default=1)
    p.add_argument("--fault", default="none",
                   choices=("none", "zero-disk-chunk", "flip-disk-byte"))
    p.add_argument("--port", type=int, default=0, help="/metrics port on 127.0.0.1 (0: any)")
    p.add_argument("--linger", type=float, default=0.0,
                   help="keep serving /metrics this many seconds after the run")
    a = p.parse_args()

    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from sidecar import signals as S
    from sidecar.adapters.lmcache import HFChunkReference, LMCacheAdapter, LMCacheMonitor
    from sidecar.core.monitor import SidecarConfig
    from sidecar.export.server import SidecarServer

    dtype = getattr(torch, a.dtype)
    model = tiny_llama(dtype)
    disk = Path(tempfile.mkdtemp(prefix="kvs-lmcache-disk-"))
    layers, kv_heads, head_dim = 2, 2, 16
    kv_shape = (layers, 2, CHUNK, kv_heads, head_dim)
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.001,
        local_disk=f"file://{disk}/", max_local_disk_size=0.1,
        lmcache_instance_id="kv-sidecar-example")
    metadata = LMCacheMetadata(model_name="tiny-llama", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=dtype,
                               kv_shape=kv_shape, chunk_size=CHUNK)
    engine = LMCacheEngineBuilder.get_or_create("kv-sidecar-example", config, metadata,
                                                cpu_connector(kv_shape),
                                                lambda t, r: None, lambda o, r: o)
    engine.post_init()

    # The sidecar: wrap the engine, attach a Monitor, serve its registry.
    adapter = LMCacheAdapter(engine, HFChunkReference(model, CHUNK))
    monitor = LMCacheMonitor(adapter, SidecarConfig(sample_every=a.sample_every,
                                                    blocks_per_sample=8)).start()
    server = SidecarServer(monitor.metrics.registry, monitor.summary, port=a.port).start()

    def serve(tokens: list[int]) -> None:
        """One request as vLLM's LMCache connector runs it: lookup, retrieve, store."""
        found = adapter.lookup(tokens)
        full = prefill(model, tokens)
        kv = torch.zeros_like(full)
        loaded = int(adapter.retrieve(tokens[:found], kvcaches=kv).sum()) if found else 0
        kv[:, :, loaded:] = full[:, :, loaded:]
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[: (loaded // CHUNK) * CHUNK] = False
        if int(mask.sum()) >= CHUNK:
            adapter.store(tokens, mask=mask, kvcaches=kv)

    rng = random.Random(0)
    prefixes = [[rng.randrange(256) for _ in range(6 * CHUNK)] for _ in range(8)]
    for i in range(a.requests):
        serve(prefixes[i % len(prefixes)] + [rng.randrange(256) for _ in range(24)])
        if i == a.requests // 2 and a.fault != "none":
            damage_a_disk_chunk(engine, prefixes[0], a.fault)
    monitor.drain(60)

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=5) as resp:
        exposition = resp.read().decode()
    m = monitor.metrics
    report = {
        "metrics_url": f"{server.url}/metrics",
        "hit_rate": m.value(S.HIT_TOKENS.name) / max(m.value(S.QUERY_TOKENS.name), 1.0),
        "lmcache_lookup_hit_rate": m.value(S.LMCACHE_LOOKUP_HIT_TOKENS.name)
        / max(m.value(S.LMCACHE_LOOKUP_TOKENS.name), 1.0),
        "verified_chunks_by_tier": m.by_label(S.LMCACHE_VERIFIED_CHUNKS.name, "tier"),
        "anomalies_by_tier_and_kind": {
            f"{tier}/{kind}": cell.value for (tier, kind), cell in
            m.instruments.families[S.LMCACHE_ANOMALIES.name].series.items() if cell.value},
        "retrieved_chunks": m.by_label(S.LMCACHE_RETRIEVED_CHUNKS.name, "tier"),
        "exposition_lines": [line for line in exposition.splitlines()
                             if line.startswith(S.LMCACHE_ANOMALIES.name) and
                             not line.endswith(" 0.0")],
    }
    print(json.dumps(report, indent=2))
    time.sleep(a.linger)
    monitor.stop()
    server.stop()
    adapter.close()
    LMCacheEngineBuilder.destroy("kv-sidecar-example")
    shutil.rmtree(disk, ignore_errors=True)


def damage_a_disk_chunk(engine: Any, tokens: list[int], fault: str) -> None:
    """Damage chunk 2 of ``tokens`` in its file on disk and drop it from the CPU tier, so
    the next request reads the damaged file (LMCache's chunk files carry no checksum)."""
    backends = engine.storage_manager.storage_backends
    keys = [k for _, _, k in engine.token_database.process_tokens(tokens=tokens)]
    key = keys[2]
    disk = backends["LocalDiskBackend"]
    deadline = time.monotonic() + 10
    while not disk.contains(key) and time.monotonic() < deadline:
        time.sleep(0.01)  # the disk tier writes asynchronously
    path = Path(disk._key_to_path(key))
    data = bytearray(path.read_bytes())
    if fault == "zero-disk-chunk":
        data = bytearray(len(data))
    else:
        data[len(data) // 3 & ~3] ^= 0x01  # the lowest mantissa bit of one element
    path.write_bytes(bytes(data))
    backends["LocalCPUBackend"].remove(key)


if __name__ == "__main__":
    main()
