"""Taps on an LMCache ``StorageManager``: which tier served each chunk, what each stored.

LMCache decides inside ``retrieve`` which backend serves which chunk
(``get_block_mapping`` then one ``batched_get`` per backend) and inside ``store`` what bytes
go to the tiers (``batched_put`` after the connector copied them from the engine). Neither
is returned to the caller, so the adapter wraps those two methods on the engine's own
storage manager instance. A tap only records while the adapter's own ``store``/``retrieve``
runs on the calling thread (a thread-local flag); every other caller passes straight
through. The wrapped methods are called exactly as before and their results returned
unchanged: the tap never alters what LMCache does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sidecar.signals import LMCacheTier

log = logging.getLogger(__name__)

_BACKEND_TIERS = {
    "LocalCPUBackend": LMCacheTier.CPU,
    "LocalDiskBackend": LMCacheTier.DISK,
    "RemoteBackend": LMCacheTier.REMOTE,
}


def tier_of(backend_name: str | None) -> LMCacheTier:
    """The bounded tier label of an LMCache backend name."""
    if backend_name is None:
        return LMCacheTier.OTHER
    return _BACKEND_TIERS.get(backend_name, LMCacheTier.OTHER)


@dataclass(frozen=True)
class ChunkGet:
    """One chunk a retrieve asked a tier for, in prefix order."""

    key: Hashable
    backend: str | None
    found: bool


@dataclass
class _Recording:
    gets: list[ChunkGet] = field(default_factory=list)
    puts: list[tuple[Hashable, str | None]] = field(default_factory=list)  # key, digest


Digest = Callable[[Any], str]  # memory object -> fingerprint


class StorageTap:
    """Wraps ``batched_get``/``batched_put`` of one storage manager (see the module doc).

    ``digest(memory_obj)`` fingerprints a chunk as LMCache is about to store it; it runs on
    the engine's thread, before the tiers see the object (the CPU tier keeps that very
    object, the disk tier writes it asynchronously). ``digest=None``: stores are recorded
    without a fingerprint.
    """

    def __init__(self, storage_manager: Any, digest: Digest | None) -> None:
        self.storage_manager = storage_manager
        self.digest = digest
        self._local = threading.local()
        self._get = storage_manager.batched_get
        self._put = storage_manager.batched_put
        storage_manager.batched_get = self._tapped_get
        storage_manager.batched_put = self._tapped_put

    def close(self) -> None:
        """Restore the storage manager's own methods."""
        self.storage_manager.batched_get = self._get
        self.storage_manager.batched_put = self._put

    def begin(self) -> None:
        self._local.recording = _Recording()

    def end(self) -> _Recording:
        rec: _Recording | None = getattr(self._local, "recording", None)
        self._local.recording = None
        return rec if rec is not None else _Recording()

    def _tapped_get(self, keys: Sequence[Hashable], location: str | None = None,
                    *args: Any, **kwargs: Any) -> Any:
        objs = self._get(keys, location, *args, **kwargs)
        rec: _Recording | None = getattr(self._local, "recording", None)
        if rec is not None:
            try:
                found = list(objs) if objs is not None else [None] * len(keys)
                rec.gets.extend(ChunkGet(k, location, o is not None)
                                for k, o in zip(keys, found, strict=False))
            except Exception:  # the tap must never change what LMCache returns
                log.exception("LMCache get tap failed (chunk outcome not recorded)")
        return objs

    def _tapped_put(self, keys: Sequence[Hashable], memory_objs: Sequence[Any],
                    *args: Any, **kwargs: Any) -> Any:
        rec: _Recording | None = getattr(self._local, "recording", None)
        if rec is not None:
            try:
                digest = self.digest
                rec.puts.extend((k, digest(m) if digest is not None else None)
                                for k, m in zip(keys, memory_objs, strict=False))
            except Exception:
                log.exception("LMCache put tap failed (chunk not fingerprinted)")
        return self._put(keys, memory_objs, *args, **kwargs)
