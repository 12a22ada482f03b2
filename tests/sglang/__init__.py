"""Tests against a real SGLang server (0.5.23) on CPU with kv-sidecar's radix-cache backend.

Run by ``scripts/test-sglang.sh`` in ``.venv-sglang`` (``pytest -m sglang tests/sglang``).
SGLang runs as ``python -m sglang.launch_server --device cpu --attention-backend
torch_native --page-size 1`` (its generic device path: the official CPU engine needs an
``sgl_kernel`` CPU build that is not on PyPI) on a tiny random Llama built from a config.

Shims, each only on the test server's PYTHONPATH (tests/sglang/shims), each for something
that cannot exist on this CPU:

* ``torchvision``: an importable placeholder. ``sglang.srt.configs`` imports torchvision at
  module level and PyPI's torchvision is CUDA-linked (it fails beside the CPU torch 2.13.0);
  SGLang's text-model path never calls it.
* ``vllm._custom_ops.rotary_embedding``: a torch rotary op. SGLang's ``RotaryEmbedding``
  imports it from vLLM on a device that is neither CUDA nor HIP; vLLM is not installed
  here (its CPU build pins a different transformers).
* ``kvsidecar_sglang_faults`` dist-info: a test-only SGLang plugin entry point that
  registers the ``kv-sidecar-faults`` backend (tests/sglang/fault_backend.py: the same
  tapped tree plus a fault hook under the tap).
"""
