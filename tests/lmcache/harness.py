"""A real LMCacheEngine (local CPU + local disk backends) beside a tiny HF Llama, driven the
way vLLM's LMCache connector drives it, with the sidecar's adapter and Monitor attached.

The "serving engine" here is the tiny model plus a flat KV buffer per request
``(2, layers, tokens, kv_heads * head_dim)``; :func:`cpu_connector` copies chunk slices
between that buffer and LMCache's memory objects (LMCache's ``MockGPUConnector`` with the
two copies filled in: ENGINES.md). A request is served as vLLM would: ``lookup``, then
``retrieve`` of what LMCache has into the request's buffer, a prefill of the rest, and
``store`` of the new chunks (masked so the retrieved prefix is not stored again).

LMCache is imported lazily, so this module imports (and its tests are deselected) in the
main venv where LMCache is not installed.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvtestbed.engines.model import ModelConfig, SequenceKV, TinyLlama
from prometheus_client import CollectorRegistry

from sidecar.adapters.lmcache import HFChunkReference, LMCacheAdapter, LMCacheMonitor
from sidecar.core.monitor import SidecarConfig

_instances = itertools.count()


def cpu_connector(kv_shape: tuple[int, int, int, int, int], skip_load: set[int] | None = None
                  ) -> Any:
    """LMCache's ``MockGPUConnector`` with the copies done on a CPU tensor. ``skip_load``:
    chunk starts whose load is silently not applied (a test-only fault)."""
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class CPUConnector(MockGPUConnector):  # type: ignore[misc]
        skipped: set[int] = skip_load if skip_load is not None else set()

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any,
                             **kwargs: Any) -> None:
            kv = kwargs["kvcaches"]
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                obj.tensor.copy_(kv[:, :, s:e])

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any,
                           **kwargs: Any) -> None:
            kv = kwargs["kvcaches"]
            for obj, s, e in zip(memory_objs, starts, ends, strict=True):
                if s not in self.skipped:
                    kv[:, :, s:e].copy_(obj.tensor)

    return CPUConnector(kv_shape)


@dataclass
class Rig:
    engine: Any
    adapter: LMCacheAdapter
    monitor: LMCacheMonitor
    model: TinyLlama
    instance_id: str
    connector: Any
    disk_dir: Path
    registry: CollectorRegistry
    served: int = 0
    stale: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def chunk_size(self) -> int:
        return self.adapter.chunk_size

    def prefill_kv(self, tokens: list[int], past: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The model's KV for ``tokens`` (after the flat KV ``past``) in the connector's
        flat layout ``(2, layers, tokens, kv_heads * head_dim)``."""
        c = self.model.config
        seq_past = None
        if past is not None and past.shape[2]:
            layers, n = int(past.shape[1]), int(past.shape[2])
            k, v = (past[i].reshape(layers, n, c.num_kv_heads, c.head_dim).permute(0, 2, 1, 3)
                    for i in (0, 1))
            seq_past = SequenceKV(k.contiguous(), v.contiguous())
        kv = self.model.prefill(tokens, past=seq_past)
        layers, heads, n, dim = kv.keys.shape
        flat = [t.permute(0, 2, 1, 3).reshape(layers, n, heads * dim)
                for t in (kv.keys, kv.values)]
        return torch.stack(flat)

    def serve(self, tokens: list[int], buffer: torch.Tensor | None = None) -> torch.Tensor:
        """One request as vLLM's connector runs it; returns the request's KV buffer (what
        the engine would decode over). The tokens LMCache did not load are prefilled after
        the loaded KV, as the engine does, so chunks stored from here on were computed
        incrementally, not by the from-scratch prefill the sidecar's recompute runs."""
        found = self.adapter.lookup(tokens)
        layers, _, _, heads, dim = self.engine.metadata.kv_shape
        kv = buffer if buffer is not None else torch.zeros(
            2, layers, len(tokens), heads * dim, dtype=self.model.dtype)
        loaded = 0
        if found:
            ret = self.adapter.retrieve(tokens[:found], kvcaches=kv)
            loaded = int(ret.sum())
        if loaded < len(tokens):  # the engine computes what it did not load
            kv[:, :, loaded:] = self.prefill_kv(tokens[loaded:], past=kv[:, :, :loaded])
        cs = self.chunk_size
        stored_upto = (loaded // cs) * cs
        if len(tokens) - stored_upto >= cs:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:stored_upto] = False
            self.adapter.store(tokens, mask=mask, kvcaches=kv)
        self.served += 1
        return kv

    # -- reaching into LMCache's own backends (to corrupt, evict or wait on them)
    def backend(self, name: str) -> Any:
        return self.engine.storage_manager.storage_backends[name]

    def chunk_key(self, tokens: list[int], index: int) -> Any:
        keys = [k for _, _, k in self.engine.token_database.process_tokens(tokens=tokens)]
        return keys[index]

    def wait_on_disk(self, key: Any, timeout_s: float = 10.0) -> Path:
        disk = self.backend("LocalDiskBackend")
        deadline = time.monotonic() + timeout_s
        while not disk.contains(key):
            if time.monotonic() > deadline:
                raise TimeoutError(f"chunk {key} never reached the disk tier")
            time.sleep(0.01)
        return Path(disk._key_to_path(key))

    def evict_from_cpu(self, key: Any) -> None:
        self.backend("LocalCPUBackend").remove(key)

    def lmcache_counter(self, name: str) -> float:
        """LMCache's own Prometheus counter (``lmcache:<name>``) for this engine, after
        flushing its stats monitor as its stats-logger thread does every 10 s."""
        import prometheus_client
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        stat_logger = LMCacheEngineBuilder._stat_loggers[self.instance_id]
        stat_logger.prometheus_logger.log_prometheus(stat_logger.monitor.get_stats_and_clear())
        labels = {k: str(v) for k, v in stat_logger.prometheus_logger.labels.items()}
        value = prometheus_client.REGISTRY.get_sample_value(f"lmcache:{name}_total", labels)
        return float(value or 0.0)

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        self.monitor.stop()
        self.adapter.close()
        LMCacheEngineBuilder.destroy(self.instance_id)


def build(tmp_path: Path, dtype: str = "float32", chunk_size: int = 16,
          cpu_gb: float = 0.02, disk_gb: float = 0.2, sample_every: int = 1,
          blocks_per_sample: int = 2, skip_load: set[int] | None = None,
          fingerprint: bool = True, **config: Any) -> Rig:
    """An LMCache engine with CPU + disk tiers under ``tmp_path``, the sidecar attached."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    model = TinyLlama(ModelConfig(dtype=dtype))
    c = model.config
    n = next(_instances)
    instance_id = f"kvs-test-{n}"
    disk_dir = tmp_path / f"lmcache-disk-{n}"
    disk_dir.mkdir()
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size, local_cpu=True, max_local_cpu_size=cpu_gb,
        local_disk=f"file://{disk_dir}/", max_local_disk_size=disk_gb,
        lmcache_instance_id=instance_id)
    kv_shape = (c.num_layers, 2, chunk_size, c.num_kv_heads, c.head_dim)
    # A model name per engine: LMCache's Prometheus series are labelled by it, so each
    # test reads its own engine's counters.
    metadata = LMCacheMetadata(model_name=f"tiny-{n}", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=model.dtype,
                               kv_shape=kv_shape, chunk_size=chunk_size)
    connector = cpu_connector(kv_shape, skip_load)
    engine = LMCacheEngineBuilder.get_or_create(instance_id, cfg, metadata, connector,
                                                lambda t, r: None, lambda o, r: o)
    engine.post_init()
    adapter = LMCacheAdapter(engine, HFChunkReference(model.model, chunk_size),
                             model="tiny-llama", fingerprint=fingerprint)
    registry = CollectorRegistry()
    sidecar = SidecarConfig(**{"sample_every": sample_every,
                               "blocks_per_sample": blocks_per_sample,
                               "recompute_tokens_per_s": 0.0, "queue_size": 4096,
                               "adapter_timeout_s": 30.0, **config})
    monitor = LMCacheMonitor(adapter, sidecar, registry).start()
    return Rig(engine, adapter, monitor, model, instance_id, connector, disk_dir, registry)
