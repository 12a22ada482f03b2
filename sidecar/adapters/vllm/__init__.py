"""vLLM adapter: event-stream audit, metrics bridge, and sampled content verification.

Importing this package (or any module but :mod:`.probe` and :mod:`.engine_config`'s vLLM
helpers) never imports vLLM, so the sidecar can run in its own environment beside the engine.

* :mod:`.events`, :mod:`.audit`, :mod:`.subscriber`, :mod:`.hashing`: the KV event stream —
  strict decoding, an index of stored blocks, re-computation of every block hash;
* :mod:`.metrics_bridge`: vLLM's own /metrics under the sidecar's signal names;
* :mod:`.probe` (runs inside vLLM), :mod:`.wire`, :mod:`.pipe`, :mod:`.receiver`,
  :mod:`.layout`, :mod:`.version`: sampled hits' KV shipped out of the engine;
* :mod:`.adapter`, :mod:`.reference`, :mod:`.service`, :mod:`.cli`: the
  :class:`sidecar.core.protocol.Adapter` for vLLM, its two references, and the runnable sidecar.
"""
