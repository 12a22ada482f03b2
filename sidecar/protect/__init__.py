"""Protecting users while the cache lies: the bounded forwarding core every proxy shares
(:mod:`sidecar.protect.forward`), the cache-bypass breaker (:mod:`sidecar.protect.breaker`)
and the guard proxy in front of an OpenAI server (:mod:`sidecar.protect.bypass_guard`).

Not :mod:`sidecar.core.time_limits`, which is about time limits on adapter calls.
"""
