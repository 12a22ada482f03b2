"""Test-only vLLM KV connector: zeroes the cached blocks a request hits, while a flag file
exists. It is the "corrupted cache" of the canary tests, inside a real OpenAI server.

Loaded like the sidecar's probe, by module path (``--kv-transfer-config`` with
``kv_connector_module_path="tests.vllm.canary_corruptor"``). The scheduler half sees each
new request's prefix-cache hit (``num_computed_tokens``) and block ids; while the flag file
named in ``kv_connector_extra_config["flag"]`` exists it asks the worker half to zero the
hit's full blocks, which ``start_load_kv`` does before the step's forward reads them. The
hit is then served from zeroed KV, exactly what a failed load reported as a hit looks like.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

log = logging.getLogger(__name__)


@dataclass
class ZeroOrders(KVConnectorMetadata):
    blocks: list[int] = field(default_factory=list)


class CanaryCorruptor(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._flag = str(extra["flag"])
        self._block_size = int(vllm_config.cache_config.block_size)
        self._kv: list[torch.Tensor] = []
        self.zeroed = 0

    # scheduler half
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ZeroOrders()
        if os.path.exists(self._flag):
            for req in scheduler_output.scheduled_new_reqs:
                n_full = int(req.num_computed_tokens) // self._block_size
                if n_full and req.block_ids:
                    meta.blocks.extend(list(req.block_ids[0])[:n_full])
        return meta

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # worker half
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = list(kv_caches.values())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, ZeroOrders) and meta.blocks:
            index = torch.tensor(meta.blocks, dtype=torch.long, device=self._kv[0].device)
            for t in self._kv:
                t.index_fill_(0, index, 0)  # in place (t[list] would zero a copy)
            self.zeroed += len(meta.blocks)
            log.warning("canary corruptor: zeroed blocks %s", meta.blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
