"""Key consistency: what the engine stored at a block versus what the hit claims it holds.

At store time the monitor records, per block, the allocation generation, a digest of the
token ids (chained over the prefix, like the engine's own block hash but computed by us) and
the key fields of the request that wrote it. At a sampled hit the same digests are computed
from the hit's tokens. A different generation means the block was handed out again since it
was indexed (boundary-off-by-one, premature free); different tokens mean the index maps other
content here (hash collision, stale index); different key fields mean the key omits a field
that changes KV (adapter, revision, salt).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sidecar.checks.base import Finding
from sidecar.protocol import BlockRef, Hit
from sidecar.signals import AnomalyKind

ROOT_DIGEST = b"kvsidecar-root"


def token_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Digest of one block's tokens chained on its parent's digest (``None``: first block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else ROOT_DIGEST)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(frozen=True)
class StoreRecord:
    """What the monitor remembers of a stored block (bounded LRU, see Monitor)."""

    generation: int
    digest: bytes  # chained token digest, valid only when ``chained``
    chained: bool
    prefix_tokens: int
    key_fields: Mapping[str, str]
    kv_digest: str | None = None


def hit_digests(hit: Hit, block_size: int, upto_index: int) -> list[bytes]:
    """Chained token digests of the hit's blocks ``0..upto_index``."""
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range(upto_index + 1):
        parent = token_digest(parent, hit.tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def check_keys(hit: Hit, ref: BlockRef, record: StoreRecord | None, block_size: int,
               generation_at_hit: int | None, digests: Sequence[bytes]) -> list[Finding]:
    """Generation, token and key-field consistency of one block; no record, no verdict.

    ``digests`` are :func:`hit_digests` of the hit, covering at least ``ref.index``.
    """
    if record is None:
        return []
    out: list[Finding] = []
    if generation_at_hit is not None and generation_at_hit != record.generation:
        out.append(Finding(AnomalyKind.STALE_GENERATION, ref.group_id, ref.index,
                           f"block {ref.block_id} generation {generation_at_hit} at hit != "
                           f"{record.generation} at store: reallocated while still indexed"))
    if record.prefix_tokens != ref.index * block_size:
        out.append(Finding(AnomalyKind.TOKEN_MISMATCH, ref.group_id, ref.index,
                           f"block {ref.block_id} was stored at token {record.prefix_tokens}, "
                           f"the hit uses it at token {ref.index * block_size}"))
    elif record.chained and digests[ref.index] != record.digest:
        out.append(Finding(AnomalyKind.TOKEN_MISMATCH, ref.group_id, ref.index,
                           f"block {ref.block_id}: the hit's tokens differ from those stored"))
    fields = set(record.key_fields) | set(hit.key_fields)
    differing = sorted(f for f in fields
                       if record.key_fields.get(f, "") != hit.key_fields.get(f, ""))
    if differing:
        out.append(Finding(AnomalyKind.KEY_FIELDS_MISMATCH, ref.group_id, ref.index,
                           f"key fields differ between store and hit: {', '.join(differing)}"))
    return out
