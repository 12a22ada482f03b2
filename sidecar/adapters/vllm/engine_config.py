"""The vLLM-side configuration that connects an engine to the sidecar.

Two things on the engine: the probe (a KV connector loaded by module path) and the KV event
publisher. :func:`probe_transfer_config` / :func:`events_config` give them as plain dicts
(``json.dumps`` them for ``--kv-transfer-config`` / ``--kv-events-config`` of the OpenAI
server); :func:`llm_kwargs` gives the ``vllm.LLM(...)`` keyword arguments; :func:`llm_submit`
is the engine reference's way to run a salted recompute on an in-process ``LLM``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sidecar.adapters.peer_settings import Setting

if TYPE_CHECKING:  # a type only: `kv-sidecar vllm ... --help` does not load torch
    from sidecar.adapters.vllm.reference import Submit

PROBE_CLASS = "KVSidecarProbe"
PROBE_MODULE = "sidecar.adapters.vllm.probe"

# What the probe reads from ``kv_connector_extra_config`` besides ``endpoint``, checked whole
# when vLLM builds it (sidecar.adapters.peer_settings): key -> (type, lowest, highest,
# default; None: the probe's own, see its docstring).
PROBE_KEYS: dict[str, Setting] = {
    "sample_every": (int, 1, 1 << 40, 100),
    "blocks_per_sample": (int, 1, 1024, 2),
    "seed": (int, 0, (1 << 63) - 1, 0),
    "burst_hits": (int, 0, 1 << 40, 0),
    "burst_every": (int, 1, 1 << 40, 1),
    "pipe_hwm": (int, 1, 1 << 20, 64),
    "capture_slots": (int, 1, 1 << 16, None),
    "fingerprint_every": (int, 0, 1 << 40, 1),
    "fingerprint_capacity": (int, 1, 1 << 24, None),
}


def probe_transfer_config(endpoint: str, sample_every: int = 100, blocks_per_sample: int = 2,
                          seed: int = 0, burst_hits: int = 0,
                          burst_every: int = 1, fingerprint_every: int = 1) -> dict[str, Any]:
    """``fingerprint_every``: 1 in N full blocks fingerprinted as the engine writes them
    (sidecar/adapters/vllm/block_writes.py; 0: off)."""
    return {"kv_connector": PROBE_CLASS, "kv_connector_module_path": PROBE_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"endpoint": endpoint, "sample_every": sample_every,
                                          "blocks_per_sample": blocks_per_sample,
                                          "seed": seed, "burst_hits": burst_hits,
                                          "burst_every": burst_every,
                                          "fingerprint_every": fingerprint_every}}


def events_config(endpoint: str, replay_endpoint: str | None = None) -> dict[str, Any]:
    """vLLM binds ``ipc://`` endpoints (the sidecar connects); with ``tcp://host:port`` it
    connects, so the sidecar must bind (``events_bind=True``)."""
    out: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": endpoint}
    if replay_endpoint:
        out["replay_endpoint"] = replay_endpoint
    return out


def llm_kwargs(probe_endpoint: str | None, events_endpoint: str | None,
               replay_endpoint: str | None = None, sample_every: int = 100,
               blocks_per_sample: int = 2, seed: int = 0,
               fingerprint_every: int = 1) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` (stats logging on: the metrics bridge reads it)."""
    from vllm.config import KVEventsConfig, KVTransferConfig

    out: dict[str, Any] = {"disable_log_stats": False, "enable_prefix_caching": True}
    if probe_endpoint:
        out["kv_transfer_config"] = KVTransferConfig(**probe_transfer_config(
            probe_endpoint, sample_every, blocks_per_sample, seed,
            fingerprint_every=fingerprint_every))
    if events_endpoint:
        out["kv_events_config"] = KVEventsConfig(**events_config(events_endpoint,
                                                                 replay_endpoint))
    return out


def llm_submit(llm: Any) -> Submit:
    """Run a salted recompute through an in-process ``vllm.LLM``. Only safe while the thread
    that owns ``llm`` is not generating (the sidecar's deferred mode guarantees it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)

    def submit(tokens: list[int], salt: str) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=tokens, cache_salt=salt)], params,
                     use_tqdm=False)
    return submit
