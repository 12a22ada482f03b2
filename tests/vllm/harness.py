"""Helpers for the real-vLLM tests: a workload with shared prefixes, an in-process engine
wired to a deferred-mode sidecar, and worker-side functions that corrupt cached blocks.

Nothing here imports vLLM at module level, so the core environment can collect tests/vllm
(and deselect it by marker).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32


@dataclass
class Workload:
    """Prefixes of 2-6 full blocks, each followed by fresh suffixes: every request after a
    prefix's first one is a prefix hit of known length."""

    seed: int = 0
    lengths: tuple[int, ...] = (70, 100, 130, 200)
    prefixes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.prefixes = [self.tokens(n) for n in self.lengths]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 500) for _ in range(n)]

    def round(self, suffix: int = 12) -> list[list[int]]:
        return [p + self.tokens(suffix) for p in self.prefixes]


@dataclass
class Engine:
    llm: Any
    sidecar: Any
    hf: Any
    engine_ref: Any
    dtype: str


def start_engine(model: str, dtype: str, sockdir: Path, sample_every: int = 1,
                 llm_extra: dict[str, Any] | None = None, blocks_per_sample: int = 2,
                 **sidecar: Any) -> Engine:
    """``sidecar``: extra SidecarConfig fields (the tolerance tests calibrate);
    ``llm_extra``: extra ``vllm.LLM`` keyword arguments; ``blocks_per_sample``: the
    probe's (the last block of each group plus earlier ones in rotation)."""
    from vllm import LLM

    from sidecar.adapters.vllm.engine_config import llm_kwargs, llm_submit
    from sidecar.adapters.vllm.metrics_bridge import registry_source
    from sidecar.adapters.vllm.reference import EngineReference, HFReference
    from sidecar.adapters.vllm.service import VllmSidecar, VllmSidecarConfig
    from sidecar.core.monitor import SidecarConfig

    probe, events, replay = (f"ipc://{sockdir}/{n}.sock" for n in ("probe", "ev", "replay"))
    holder: dict[str, Any] = {}
    cfg = VllmSidecarConfig(
        model_dir=model, dtype=dtype, block_size=BLOCK, probe_endpoint=probe,
        events_endpoint=events, replay_endpoint=replay, reference="engine", deferred=True,
        sidecar=SidecarConfig(sample_every=1, adapter_timeout_s=20.0,
                              recompute_tokens_per_s=0, **sidecar))
    sc = VllmSidecar(cfg, submit=lambda t, s: holder["submit"](t, s),
                     metrics_source=registry_source()).start()
    llm = LLM(model=model, dtype=dtype, block_size=BLOCK, enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=1024, seed=0,
              **llm_kwargs(probe, events, replay, sample_every=sample_every,
                           blocks_per_sample=blocks_per_sample),
              **(llm_extra or {}))
    holder["submit"] = llm_submit(llm)
    engine_ref = sc.adapter.reference
    assert isinstance(engine_ref, EngineReference)
    return Engine(llm, sc, HFReference(model, sc.info), engine_ref, dtype)


def stop_engine(eng: Engine) -> None:
    """Shut the engine down for real: vLLM keeps the worker's KV connector in a process
    global, and a later engine in the same process would reuse a stale one."""
    eng.sidecar.stop()
    core = getattr(eng.llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


def without_fingerprints(sample: Any) -> Any:
    """``sample`` with the probe's write-time digests taken out (write paths kept): what the
    recompute alone makes of it (the fingerprint stage would condemn a changed block first)."""
    import dataclasses

    from sidecar.core.protocol import BlockWrite

    return dataclasses.replace(sample, writes={
        r: BlockWrite(w.write_path, None, w.epoch) for r, w in sample.writes.items()})


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 2) -> list[Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return list(llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                             SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             use_tqdm=False))


def vllm_counter(llm: Any, name: str) -> float:
    """A counter from vLLM's own metrics (summed over its labels)."""
    return float(sum(m.value for m in llm.get_metrics() if m.name == name))


# Worker-side functions for LLM.collective_rpc: they run inside vLLM's worker, where
# ``worker.model_runner.kv_caches`` holds one paged tensor per layer.
def zero_block(worker: Any, block_id: int) -> int:
    for t in worker.model_runner.kv_caches:
        t[block_id].zero_()
    return len(worker.model_runner.kv_caches)


def copy_block(worker: Any, src: int, dst: int) -> int:
    """Overwrite ``dst`` with ``src``'s KV: realistic values, wrong content (stale reuse)."""
    for t in worker.model_runner.kv_caches:
        t[dst].copy_(t[src])
    return len(worker.model_runner.kv_caches)


def add_layer_noise(worker: Any, block_id: int, layer: int, scale: float, seed: int = 0
                    ) -> float:
    """Add ``scale * std * N(0, 1)`` to every K/V element of one layer of ``block_id``
    (``std``: of that layer's block; computed in float32, stored back in the cache's dtype):
    the silent corruption a tolerance cannot see. Returns the share of elements changed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = worker.model_runner.kv_caches[layer]
    before = t[block_id].clone()
    x = before.float()
    x += scale * x.std() * torch.randn(x.shape, generator=g)
    t[block_id].copy_(x.to(t.dtype))
    return float((t[block_id] != before).float().mean())


def add_noise(worker: Any, block_id: int, relative: float, seed: int = 0) -> int:
    """Multiply every K/V element of ``block_id`` by ``1 + relative * N(0, 1)`` (computed in
    float32, stored back in the cache's dtype): a small, silent corruption."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in worker.model_runner.kv_caches:
        x = t[block_id].float()
        x *= 1 + relative * torch.randn(x.shape, generator=g)
        t[block_id].copy_(x.to(t.dtype))
    return len(worker.model_runner.kv_caches)
