"""The reference engine's configuration: model, pool shape, fault, storage, tier, truth.

Kept apart from the engine so callers that only describe a run (the demo's options, the
benchmark's scenarios) need not reach into the engine module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtestbed.engines.model import ModelConfig

DigestFn = Callable[[torch.Tensor, torch.Tensor], str]


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes the engine. ``kv_digest`` reports a write-time fingerprint of
    each stored block (costs a hash of the block's bytes per store)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # Which model (``reference``: the tiny Llama; ``hybrid``: Gemma2 sliding + full;
    # ``recurrent``: LFM2 conv state + full, see hybrid_model.py) and, for ``hybrid``,
    # the sliding window in tokens. Hybrid models run on HybridEngine (hybrid_engine.py).
    model_kind: str = "reference"
    sliding_window: int = 32
    block_size: int = 16
    num_blocks: int = 128
    max_running: int = 4
    kv_digest: bool = False
    fault: str = "none"
    fault_seed: int = 0
    fault_start_after: int | None = None  # None: the fault's own default
    fault_probability: float | None = None  # None: the fault's own default
    fault_params: dict[str, Any] = field(default_factory=dict)  # fault-specific knobs
    # Lossy KV storage ("int8": quantised values + per-row scales, see quant.py); None
    # stores KV in the model dtype.
    kv_storage: str | None = None
    # Blocks the CPU offload tier holds (0 = no tier): evicted cached blocks spill there and
    # a later lookup loads them back as hits (tier.py).
    cpu_offload_blocks: int = 0
    # Keep the ground truth of which blocks hold wrong KV (truth.py): for the detection
    # benchmark; costs a shadow copy of the pool.
    track_truth: bool = False
    # Intra-op threads for torch (process-wide). The model's matmuls are tiny: extra threads
    # buy nothing and, when the cores are shared (the sidecar's recompute, other processes),
    # their spin-waiting made a decode step 10x slower in measurements. None: leave as is.
    torch_threads: int | None = 1
    # Where the model runs and the pool's KV lives ("cpu", "cuda", "cuda:N"; checked by
    # sidecar.core.device.resolve_device: asking for CUDA without one is an error, not a fallback).
    device: str = "cpu"
