"""The settings an in-engine probe or tap reads from the engine's side, checked whole.

The vLLM probe takes them from ``kv_connector_extra_config``, the SGLang tap from the
``KVSIDECAR_SGLANG_TAP`` environment variable: both are written by hand (or by
``engine-args``, which checks what it prints against the same table) into another program's
configuration, where a bad value would otherwise surface late and inside the engine (a block
size of 0 raised on every insert) or not at all (a misspelt key quietly fell back to its
default). :func:`check_settings` refuses an unknown key, a value of the wrong type or out of
range, and an endpoint off this host, naming every problem in one ``ValueError`` that stops
the engine at start.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sidecar.adapters.vllm.endpoints import check_peer_endpoint
from sidecar.config.toml_file import json_object_once

# key -> (int or float, lowest, highest, default); a default of None means "computed by the
# probe" (the key may be left out, or given in range).
Setting = tuple[type, float, float, Any]


def _shown(value: Any) -> str:
    """A value as a message shows it: as JSON wrote it for JSON's own constants (``true``,
    ``null``, ``NaN``: the settings are JSON), else its repr; cut short (a peer may send
    megabytes)."""
    text = json.dumps(value) if value is None or type(value) in (bool, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bound(kind: type, x: float) -> str:
    return str(int(x)) if kind is int else f"{x:g}"


def check_settings(raw: Any, keys: Mapping[str, Setting], where: str) -> dict[str, Any]:
    """``raw`` (a mapping with a string ``endpoint``) checked against ``keys``: every key of
    ``keys`` in the result, defaults filled in. ``where`` names the setting in messages."""
    try:
        given = dict(raw) if isinstance(raw, Mapping) else None
    except Exception:  # a mapping whose own methods raise
        given = None
    if given is None:
        raise ValueError(f"{where} must be a JSON object with a string 'endpoint' (the "
                         "sidecar's probe socket, e.g. ipc:///tmp/kvsidecar.sock)")
    unknown = [_shown(k) for k in given if k != "endpoint" and k not in keys]
    problems = [f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown[:5])}"
                f"{' ...' if len(unknown) > 5 else ''} (known: endpoint, {', '.join(keys)})"
                ] if unknown else []
    if not isinstance(given.get("endpoint"), str):  # named with the rest, not alone
        problems.append(f"'endpoint' must be a string (the sidecar's probe socket, e.g. "
                        f"ipc:///tmp/kvsidecar.sock), got {_shown(given.get('endpoint'))}")
    else:
        try:  # the KV it ships goes only where a sidecar on this host could listen
            check_peer_endpoint(given["endpoint"])
        except ValueError as exc:
            problems.append(str(exc))
    out: dict[str, Any] = {"endpoint": given.get("endpoint")}
    for key, (kind, low, high, default) in keys.items():
        value: Any = given.get(key, default)
        if value is None and default is None:
            out[key] = None
            continue
        number = type(value) in (int, float)  # not bool, not a str or a numpy scalar
        if not number or (kind is int and type(value) is not int) \
                or not low <= value <= high:  # NaN fails the range test too
            problems.append(f"{key} must be {'an integer' if kind is int else 'a number'} "
                            f"in [{_bound(kind, low)}, {_bound(kind, high)}], "
                            f"got {_shown(value)}")
            continue
        out[key] = kind(value)
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return out


def parse_settings(text: str, where: str) -> Any:
    """JSON ``text`` as written into an engine's environment: a key given twice, nesting too
    deep or a number too long is a ValueError naming ``where`` (never a RecursionError)."""
    try:
        return json.loads(text, object_pairs_hook=json_object_once)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{where} is not JSON: {str(exc)[:120] or 'nested too deep'}") \
            from None
