"""The request's key values as the tap sends them: bounded, and always packable.

SGLang's radix key namespaces a prefix by ``extra_key`` and ``cache_salt``, and a client
chooses ``extra_key``: a value longer than :data:`KEY_VALUE_CHARS`, or not valid UTF-8 (a
lone surrogate, which JSON can carry and msgpack refuses: every store and capture naming it
would be lost), travels as its SHA-256, so stores and captures stay small and packable and
compare equal exactly when the values do.
"""

from __future__ import annotations

import hashlib
from typing import Any

KEY_VALUE_CHARS = 256


def key_fields(extra_key: Any, cache_salt: Any) -> dict[str, str]:
    """The request's own values of what SGLang's radix key namespaces by, each bounded
    (module docstring)."""
    return {"extra_key": _bounded(str(extra_key or "")),
            "cache_salt": _bounded(str(cache_salt or ""))}


def _bounded(value: str) -> str:
    """``value``, or its hash when it is long or not valid UTF-8 (a lone surrogate, which
    JSON can carry: msgpack cannot encode it, and the message naming it would be lost)."""
    if len(value) <= KEY_VALUE_CHARS and (value.isascii() or _encodable(value)):
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def _encodable(value: str) -> bool:
    try:
        value.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
