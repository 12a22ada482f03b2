"""The settings an in-engine probe or tap reads from the engine's side, checked whole.

The vLLM probe takes them from ``kv_connector_extra_config``, the SGLang tap from the
``KVSIDECAR_SGLANG_TAP`` environment variable: both are written by hand (or by
``engine-args``) into another program's configuration, where a bad value would otherwise
surface late and inside the engine (a block size of 0 raised on every insert) or not at all
(a misspelt key quietly fell back to its default). :func:`check_settings` refuses an unknown
key, a value of the wrong type or out of range, and an endpoint off this host, naming every
problem in one ``ValueError`` that stops the engine at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sidecar.adapters.vllm.endpoints import check_peer_endpoint

# key -> (int or float, lowest, highest, default); a default of None means "computed by the
# probe" (the key may be left out, or given in range).
Setting = tuple[type, float, float, Any]


def check_settings(raw: Any, keys: Mapping[str, Setting], where: str) -> dict[str, Any]:
    """``raw`` (a mapping with a string ``endpoint``) checked against ``keys``: every key of
    ``keys`` in the result, defaults filled in. ``where`` names the setting in messages."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("endpoint"), str):
        raise ValueError(f"{where} must be a JSON object with a string 'endpoint' (the "
                         "sidecar's probe socket, e.g. ipc:///tmp/kvsidecar.sock)")
    problems = [f"unknown key {k!r} (known: endpoint, {', '.join(keys)})"
                for k in raw if k != "endpoint" and k not in keys]
    try:  # the KV it ships goes only where a sidecar on this host could listen
        check_peer_endpoint(raw["endpoint"])
    except ValueError as exc:
        problems.append(str(exc))
    out: dict[str, Any] = {"endpoint": raw["endpoint"]}
    for key, (kind, low, high, default) in keys.items():
        value = raw.get(key, default)
        if value is None and default is None:
            out[key] = None
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or (kind is int and not isinstance(value, int)) \
                or not low <= value <= high:  # NaN fails the range test too
            problems.append(f"{key} must be {'an integer' if kind is int else 'a number'} "
                            f"in [{low:g}, {high:g}], got {value!r}")
            continue
        out[key] = kind(value)
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return out
