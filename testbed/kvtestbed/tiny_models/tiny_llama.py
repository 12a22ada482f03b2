"""A tiny randomly initialised Llama checkpoint (and tokenizer) for tests and examples.

Nothing is downloaded: the weights come from ``torch.manual_seed(seed)`` and a config small
enough for a 2-core CPU, but shaped for vLLM's CPU backend, which only accepts head sizes
32, 64, 80, ... 256 (so ``hidden_size / num_attention_heads >= 32``). The tokenizer is a
word-level one over ``w0 .. wN`` built with the ``tokenizers`` package, so the OpenAI server
can detokenize; tests send token ids directly.

Used by ``tests/vllm`` and ``examples/vllm`` alike: the HF reference loads the very same
directory vLLM serves from, which is what makes the HF recompute an independent check of the
same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def write_tiny_llama(path: str | Path, seed: int = 0, num_layers: int = 2,
                     hidden_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                     max_positions: int = 2048) -> Path:
    """Write a tiny Llama (fp32 safetensors + config + tokenizer) to ``path``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(out, safe_serialization=True)
    _write_tokenizer(out)
    return out


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(VOCAB_SIZE - len(SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
