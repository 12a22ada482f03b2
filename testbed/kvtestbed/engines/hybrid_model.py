"""The reference engine's hybrid models: tiny randomly initialised transformers hybrids.

* ``hybrid``: a Gemma2 with sliding-window and full-attention layers alternating (Gemma2 and
  Gemma3 both interleave them). Two cache groups: the full layers keep every position, the
  sliding layers only the last ``sliding_window - 1``.
* ``recurrent``: an LFM2 with short-convolution layers and full-attention layers. The conv
  layers keep a fixed-size state (the last ``conv_L_cache`` inputs of the conv, per channel)
  instead of per-position KV: a recurrent-state group.

The past is handed to the model as tensors taken from the engine's pools, so the model
decodes over exactly what the cache holds. Every attention layer gets a *full-length*
``DynamicLayer``; a sliding layer's positions before its window are masked by the model's
sliding-window mask whatever they hold, so a null (zero) block there changes nothing —
measured bit-exact against a full prefill — while a zero at an in-window position does.
No hub downloads: configs are written here and weights seeded by ``(seed, revision)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, Lfm2Config, Lfm2ForCausalLM

from kvtestbed.engines.model import ModelConfig, derive_seed
from sidecar.adapters.hf_cache import cache_argument

HYBRID_MODELS = ("hybrid", "recurrent")
FULL, SLIDING, CONV = "full_attention", "sliding_attention", "conv"

# layer index -> (K, V), each (kv_heads, tokens, head_dim); layer index -> conv state
AttnKV = dict[int, tuple[torch.Tensor, torch.Tensor]]
ConvState = dict[int, torch.Tensor]


@dataclass(frozen=True)
class HybridShape:
    """What the engine needs to lay out its pools for a hybrid model."""

    layer_types: tuple[str, ...]
    sliding_window: int | None
    state_shape: tuple[int, ...] = ()  # one conv layer's state, (channels, conv_L_cache)

    def layers(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)


@dataclass
class StepOutput:
    """K/V of the tokens just run, the conv states after them (and at block boundaries
    crossed on the way, when asked), and the last token's logits."""

    kv: AttnKV
    state: ConvState
    last_logits: torch.Tensor
    boundary_states: dict[int, ConvState] = field(default_factory=dict)  # end pos -> state

    @property
    def next_token(self) -> int:
        return int(torch.nan_to_num(self.last_logits.float(), nan=-1e30).argmax())


def _hf_config(kind: str, c: ModelConfig, sliding_window: int) -> Any:
    params: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        max_position_embeddings=c.max_positions, attn_implementation="eager")
    if kind == "hybrid":
        # Gemma2 ties its embeddings (ENGINES.md); eager attention: its softcapping has no
        # SDPA path in transformers.
        params.update(head_dim=c.head_dim, sliding_window=sliding_window,
                      layer_types=[SLIDING if i % 2 == 0 else FULL
                                   for i in range(c.num_layers)],
                      tie_word_embeddings=True)
        return Gemma2Config(**params)
    if kind == "recurrent":
        # The sizes vLLM's LFM2 config reads too (ENGINES.md), so one config fits both.
        params.update(layer_types=[CONV if i % 2 == 0 else FULL for i in range(c.num_layers)],
                      conv_dim=c.hidden_size, block_dim=c.hidden_size,
                      block_ff_dim=c.intermediate_size, norm_eps=1e-5)
        return Lfm2Config(**params)
    raise ValueError(f"unknown hybrid model {kind!r}; known: {', '.join(HYBRID_MODELS)}")


class HybridLM:
    """A seeded Gemma2 or LFM2 that runs tokens after an explicit past (per-layer K/V for
    attention layers, conv states for conv layers). Forward passes do not mutate the
    module, so the engine thread and the sidecar's recompute may run it concurrently."""

    def __init__(self, kind: str, config: ModelConfig, sliding_window: int = 32) -> None:
        self.kind = kind
        self.config = c = config
        self.hf_config = _hf_config(kind, c, sliding_window)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(c.seed, "weights", kind, c.revision))
            model = (Gemma2ForCausalLM if kind == "hybrid" else Lfm2ForCausalLM)(self.hf_config)
        model.requires_grad_(False)
        for p in model.parameters():
            p.data = p.data.to(c.torch_dtype)
        self.model = model.eval()
        self._cache_kw = cache_argument(model)  # past_key_values, or cache where renamed
        self.dtype = c.torch_dtype
        types = tuple(self.hf_config.layer_types)
        state_shape: tuple[int, ...] = ()
        if CONV in types:
            state_shape = (c.hidden_size, int(self.hf_config.conv_L_cache))
        self.shape = HybridShape(types, sliding_window if kind == "hybrid" else None,
                                 state_shape)
        emb = self.model.get_input_embeddings().weight
        self._embed_rms = float(emb.float().pow(2).mean().sqrt())
        self._adapter_bias: dict[str, torch.Tensor] = {}

    def adapter_bias(self, adapter: str) -> torch.Tensor | None:
        """A per-adapter embedding bias, as :class:`TinyLlama` has (key fields matter)."""
        if not adapter:
            return None
        bias = self._adapter_bias.get(adapter)
        if bias is None:
            g = torch.Generator().manual_seed(derive_seed("adapter", adapter))
            raw = torch.randn(self.config.hidden_size, generator=g)
            bias = (raw * (self.config.adapter_scale * self._embed_rms)).to(self.dtype)
            self._adapter_bias[adapter] = bias
        return bias

    def _cache(self, kv: AttnKV | None, state: ConvState | None) -> DynamicCache:
        """A transformers cache holding ``kv`` and ``state``: full-length DynamicLayers for
        every attention layer (the model's masks enforce the sliding window)."""
        types = self.shape.layer_types
        if CONV not in types:
            cache = DynamicCache()
            if kv:
                for i in range(len(types)):
                    k, v = kv[i]
                    cache.update(k.unsqueeze(0), v.unsqueeze(0), i)
            return cache
        cache = DynamicCache(config=self.hf_config)
        for i, layer in enumerate(cache.layers):
            if types[i] == CONV and state:
                s = state[i].unsqueeze(0)
                lin = cast(Any, layer)
                lin.lazy_initialization(conv_states=s)
                lin.conv_states[0].copy_(s)
                lin.has_previous_state[0] = True
            elif types[i] != CONV and kv:
                k, v = kv[i]
                cast(Any, layer).update(k.unsqueeze(0), v.unsqueeze(0))
        return cache

    def _read(self, cache: DynamicCache, start: int) -> tuple[AttnKV, ConvState]:
        kv: AttnKV = {}
        state: ConvState = {}
        for i, layer in enumerate(cache.layers):
            if self.shape.layer_types[i] == CONV:
                state[i] = cast(Any, layer).conv_states[0][0].clone()
            else:
                lay = cast(Any, layer)
                kv[i] = (lay.keys[0, :, start:].clone(), lay.values[0, :, start:].clone())
        return kv, state

    def forward(self, tokens: Sequence[int], adapter: str = "", start: int = 0,
                kv: AttnKV | None = None, state: ConvState | None = None,
                boundaries: Sequence[int] = ()) -> StepOutput:
        """Run ``tokens`` at positions ``start..`` after the past ``kv``/``state``. With
        ``boundaries`` (absolute positions ending a block), the prompt runs in chunks cut
        there and the conv state reached at each is returned too (a recurrent group caches
        one state per block boundary)."""
        if not tokens:
            raise ValueError("forward needs at least one token")
        if start + len(tokens) > self.config.max_positions:
            raise ValueError(f"{start + len(tokens)} positions exceed max_positions "
                             f"{self.config.max_positions}")
        end = start + len(tokens)
        cuts = sorted({b for b in boundaries if start < b < end} | {end})
        bias = self.adapter_bias(adapter)
        out_states: dict[int, ConvState] = {}
        with torch.inference_mode():
            cache = self._cache(kv, state)
            pos = start
            logits = None
            for cut in cuts:
                ids = torch.tensor([list(tokens[pos - start:cut - start])], dtype=torch.long)
                embeds = self.model.get_input_embeddings()(ids)
                if bias is not None:
                    embeds = embeds + bias
                positions = torch.arange(pos, cut).unsqueeze(0)
                out = self.model(inputs_embeds=embeds, use_cache=True, position_ids=positions,
                                 logits_to_keep=1, **{self._cache_kw: cache})
                logits = out.logits[0, -1]
                if cut in boundaries:
                    out_states[cut] = self._read(cache, 0)[1]
                pos = cut
            new_kv, new_state = self._read(cache, start)
        assert logits is not None
        return StepOutput(new_kv, new_state, logits, out_states)

    def prefill(self, tokens: Sequence[int], adapter: str = "") -> StepOutput:
        """From scratch, one forward: the reference computation for recompute."""
        return self.forward(tokens, adapter)


def model_config(kind: str, dtype: str = "float32", seed: int = 0) -> ModelConfig:
    """The tiny model each ``--model`` runs: the plain Llama, or a 4-layer hybrid (two
    layers per cache group, hidden 64) that stays cheap on a shared CPU."""
    if kind == "reference":
        return ModelConfig(dtype=dtype, seed=seed)
    if kind not in HYBRID_MODELS:
        raise ValueError(f"unknown model {kind!r}; known: reference, {', '.join(HYBRID_MODELS)}")
    name = "tiny-gemma2" if kind == "hybrid" else "tiny-lfm2"
    return ModelConfig(name=name, dtype=dtype, seed=seed, num_layers=4)
