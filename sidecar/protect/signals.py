"""The cache-bypass guard's own signals; registered by the guard.
"""

from __future__ import annotations

from sidecar.core.signal_types import C, G, Signal
from sidecar.core.signal_types import signal as _s

# --- cache-bypass guard (sidecar/protect/, issue 25): a proxy in front of an OpenAI server
# that salts every request while its breaker is open. Registered by the guard only
# (ADAPTER_SIGNALS["guard"]). Bounded labels: state (closed, open, half_open), to, source
# (local, sidecar, webhook, operator, timer, probes), route (forwarded, bypassed, probe,
# unprotected), status (the few HTTP statuses a proxy answers itself).
GUARD_STATE = _s("guard_state", G,
                 "1 for the cache-bypass guard's current breaker state (closed, open, "
                 "half_open), 0 for the others. Open: every request gets a fresh "
                 "cache_salt and the engine serves no cache hit.", ("state",))
GUARD_TRANSITIONS = _s("guard_transitions_total", C,
                       "Guard breaker transitions, by the state entered and what moved it "
                       "(local verdict, sidecar /status, webhook page, operator, timer, "
                       "probes).", ("to", "source"))
GUARD_REQUESTS = _s("guard_requests_total", C,
                    "Requests through the guard, by route: forwarded (as sent), bypassed "
                    "(salted: a cache miss), probe (half-open, with the cache and verified), "
                    "unprotected (open, not salted: the server ignores cache_salt, or a body "
                    "that cannot be), refused (open, an unsaltable generation request).",
                    ("route",))
GUARD_BYPASS_SUPPORTED = _s("guard_bypass_supported", G,
                            "1 where the server honours cache_salt (the guard can bypass "
                            "its cache), 0 where it can only alert.")
GUARD_STATUS_FAILURES = _s("guard_status_failures_total", C,
                           "Reads of the watched sidecar's /status (--sidecar-status) that "
                           "failed: unreachable, refused, too large, or not a kv-sidecar's "
                           "status (each also logged). Rising: the guard is not watching.")
PROXY_REFUSED = _s("proxy_refused_total", C,
                   "Requests a kv-sidecar proxy answered itself with an error, by HTTP "
                   "status (400, 408, 411, 413, 431, 502, 503, 504).", ("status",))
GUARD_SIGNALS: tuple[Signal, ...] = (GUARD_STATE, GUARD_TRANSITIONS, GUARD_REQUESTS,
                                     GUARD_BYPASS_SUPPORTED, GUARD_STATUS_FAILURES,
                                     PROXY_REFUSED)

