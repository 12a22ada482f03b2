"""kv-sidecar for LMCache: verifies what LMCache's storage tiers return.

Wrap an ``LMCacheEngine`` in :class:`LMCacheAdapter`, attach an :class:`LMCacheMonitor`,
and call the adapter's ``store`` / ``lookup`` / ``retrieve`` where the engine's were called.
LMCache itself is not imported here: the adapter only calls the engine object it is given.
"""

from sidecar.adapters.lmcache.adapter import ChunkHit, LMCacheAdapter
from sidecar.adapters.lmcache.layout import FlatServedKV, ServedKV, chunk_to_block
from sidecar.adapters.lmcache.reference import HFChunkReference
from sidecar.adapters.lmcache.tier_monitor import LMCacheMonitor

__all__ = ["ChunkHit", "FlatServedKV", "HFChunkReference", "LMCacheAdapter",
           "LMCacheMonitor", "ServedKV", "chunk_to_block"]
