"""What the HuggingFace references and the testbed's hybrid models share about transformers'
cache argument (one place, so no caller hard-codes a name transformers is renaming)."""

from __future__ import annotations

import inspect
from typing import Any


def cache_argument(model: Any) -> str:
    """The keyword ``model``'s forward takes a KV cache under: transformers renames
    ``past_key_values`` to ``cache`` model by model (5.25's Gemma2 and LFM2 warn on the old
    name; earlier releases know only it)."""
    return ("cache" if "cache" in inspect.signature(model.forward).parameters
            else "past_key_values")
