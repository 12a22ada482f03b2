"""``dispatch = "process"``: the Monitor's hooks in the engine's process, everything else
(journal apply, verification, reporting, HTTP) in a sidecar process of its own.

* :mod:`.front` — the engine's side: hooks, sampler, capture;
* :mod:`.outbox` — its outbox and the shipper thread that sends it in order;
* :mod:`.messages` — the allocator census and a capture's hit extras, both ends;
* :mod:`.child` — the sidecar process: a Monitor over :class:`~.child.RemoteAdapter`;
* :mod:`.process` — :class:`~.process.SidecarProcess`, what an engine's owner starts.
"""
