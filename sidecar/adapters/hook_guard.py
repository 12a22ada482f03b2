"""A guard for an adapter's own engine-side hook code (translating engine events into
``Lookup``/``StoredBlock`` calls), for adapters whose sink is not necessarily a Monitor
(where it is, :meth:`sidecar.core.monitor.Monitor.guarded` also feeds
``kvsidecar_hook_errors_total``). Whatever the hook raises is counted on the adapter's
``hook_errors`` and logged once per hook; the engine never sees it."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def never_raises(hook: Callable[..., None]) -> Callable[..., None]:
    """Decorate an adapter method: errors counted on ``self.hook_errors``, never raised."""
    logged: set[int] = set()

    @functools.wraps(hook)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            hook(self, *args, **kwargs)
        except Exception:
            self.hook_errors = getattr(self, "hook_errors", 0) + 1
            if id(self) not in logged:
                logged.add(id(self))
                log.exception("adapter hook %s failed (counted; engine unaffected)",
                              hook.__name__)
    return guarded
