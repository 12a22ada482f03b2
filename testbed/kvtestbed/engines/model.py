"""The reference engine's model: a tiny randomly initialised Llama, no downloads.

The model is small enough that a 500-token prefill takes milliseconds on a CPU, yet it is a
real transformer (RoPE, GQA, RMSNorm), so cached KV depends on every earlier token and on its
position, and a corrupted block really changes what the model decodes.

Two context fields change the KV for the same tokens, as they do in real engines:

* ``revision``: the weights are seeded by ``(seed, revision)``; a different revision is a
  different model (the engine loads one, and records it in its key fields);
* ``adapter``: a LoRA-like per-adapter bias added to the input embeddings, seeded by the
  adapter's name ("" = no adapter). Two requests with different adapters and the same tokens
  get different KV, so a cache key that forgets the adapter serves the wrong KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (Python's ``hash`` is salted per run)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and identity of the tiny model. ``head_dim`` is ``hidden_size / num_heads``."""

    name: str = "tiny-llama"
    revision: str = "r1"
    seed: int = 0
    dtype: str = "float32"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 2048
    # Adapter bias RMS relative to the embedding RMS: large enough to move every K/V by far
    # more than any dtype's noise, small enough that tokens still dominate the embedding.
    adapter_scale: float = 0.5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class SequenceKV:
    """K and V of consecutive positions, shape ``(layers, kv_heads, tokens, head_dim)``."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])


@dataclass(frozen=True)
class ForwardOutput:
    """KV of the tokens just run (not of the past) and the logits of the last one."""

    kv: SequenceKV
    last_logits: torch.Tensor

    @property
    def next_token(self) -> int:
        """Greedy choice; NaN logits (a nonfinite cache) still give a deterministic token."""
        return int(torch.nan_to_num(self.last_logits.float(), nan=-1e30).argmax())


def _tensor(t: torch.Tensor | None) -> torch.Tensor:
    if t is None:
        raise RuntimeError("the model did not fill its KV cache")
    return t


class TinyLlama:
    """A seeded ``LlamaForCausalLM`` that runs tokens after an explicit past KV.

    The past is passed in as tensors (gathered from the paged pool by the engine), so the
    model sees exactly what the cache holds; positions continue at the past's length.
    Forward passes do not mutate the module, so the engine thread and the sidecar's
    recompute may call :meth:`forward` concurrently.
    """

    def __init__(self, config: ModelConfig | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.config = config or ModelConfig()
        self.device = torch.device(device)
        c = self.config
        hf_config = LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            max_position_embeddings=c.max_positions,
        )
        # fork_rng: seeding must not disturb the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, "weights", c.revision))
            model = LlamaForCausalLM(hf_config)
        model.requires_grad_(False)
        for p in model.parameters():  # in place: PreTrainedModel.to is awkwardly typed
            p.data = p.data.to(c.torch_dtype)
        emb = model.model.embed_tokens.weight
        self._embed_rms = float(emb.float().pow(2).mean().sqrt())  # on the host: no sync
        # Parameters and buffers (rotary inv_freq) to the device, buffers keeping their dtype.
        torch.nn.Module.to(model, self.device)
        self.model = model.eval()
        self.dtype = c.torch_dtype
        self._adapter_bias: dict[str, torch.Tensor] = {}

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def adapter_bias(self, adapter: str) -> torch.Tensor | None:
        """The adapter's embedding bias (``None`` for no adapter), deterministic by name."""
        if not adapter:
            return None
        bias = self._adapter_bias.get(adapter)
        if bias is None:
            g = torch.Generator().manual_seed(derive_seed("adapter", adapter))
            raw = torch.randn(self.config.hidden_size, generator=g)
            bias = (raw * (self.config.adapter_scale * self._embed_rms)).to(self.device,
                                                                             self.dtype)
            self._adapter_bias[adapter] = bias
        return bias

    def forward(self, tokens: Sequence[int], adapter: str = "",
                past: SequenceKV | None = None) -> ForwardOutput:
        """Run ``tokens`` after ``past`` and return their KV and the last token's logits."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        n_past = 0 if past is None else past.num_tokens
        if n_past + len(tokens) > self.config.max_positions:
            raise ValueError(f"{n_past + len(tokens)} positions exceed max_positions "
                             f"{self.config.max_positions}")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            embeds = self.model.model.embed_tokens(ids)
            bias = self.adapter_bias(adapter)
            if bias is not None:
                embeds = embeds + bias
            if past is None:
                cache = DynamicCache(config=self.model.config)
            else:
                cache = DynamicCache(
                    ddp_cache_data=[(past.keys[i].unsqueeze(0), past.values[i].unsqueeze(0))
                                    for i in range(self.num_layers)],
                    config=self.model.config)
            positions = torch.arange(n_past, n_past + len(tokens),
                                     device=self.device).unsqueeze(0)
            out = self.model(inputs_embeds=embeds, cache=cache, use_cache=True,
                             position_ids=positions, logits_to_keep=1)
            # Updated in place: the past plus the tokens just run. A Llama cache has only
            # full-attention DynamicLayers (the cast narrows transformers' layer union).
            layers = [cast(DynamicLayer, layer) for layer in cache.layers]
            keys = torch.stack([_tensor(layer.keys)[0, :, n_past:] for layer in layers])
            values = torch.stack([_tensor(layer.values)[0, :, n_past:] for layer in layers])
        return ForwardOutput(SequenceKV(keys, values), out.logits[0, -1])

    def prefill(self, tokens: Sequence[int], adapter: str = "",
                past: SequenceKV | None = None) -> SequenceKV:
        """KV of ``tokens`` (after ``past``); the reference computation for recompute."""
        return self.forward(tokens, adapter, past).kv

    def decode_step(self, token: int, adapter: str, past: SequenceKV) -> ForwardOutput:
        """One greedy decode step: the KV of ``token`` at position ``len(past)``."""
        return self.forward([token], adapter, past)
