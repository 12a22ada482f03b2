"""Test-only stand-in for the one vLLM op SGLang's generic (non-CUDA) rotary path imports
(see tests/sglang/__init__.py). Not vLLM: only ``vllm._custom_ops.rotary_embedding``."""
