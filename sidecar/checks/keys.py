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

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from sidecar.checks.base import Finding
from sidecar.core.protocol import BlockRef, Hit
from sidecar.signals import AnomalyKind

ROOT_DIGEST = 0x6B7673696465636172  # "kvsidecar": the parent of every first block
# Token ids are vocabulary indices; every engine keeps them in an int32 tensor (vocabularies
# are under a million). Past this a value is not a token id, whatever its type.
MAX_TOKEN_ID = (1 << 31) - 1
_TEXT = (str, bytes, bytearray)


def token_ids_problem(hit: Hit, needed: int) -> str | None:
    """Why ``hit.tokens`` cannot be checked, or ``None``: a sequence of ints in ``[0,
    MAX_TOKEN_ID]``, at least ``hit_tokens`` of them (the protocol's promise: the recompute
    and the evidence record read them all) and at least ``needed`` (the chosen blocks').

    The hook path never walks a hit's tokens (O(1) per unsampled hit); the verifier asks
    this first, off the engine's thread. Without it a ``True`` or ``1.0`` hashes like ``1``
    (the digests would match stored ints), ``[[1]]`` fails the hash and ``"a"`` the recompute
    and the evidence record: tracebacks and false token mismatches for what is bad input, a
    counted drop (``bad_tokens``). Never raises: a sequence whose own methods raise is a
    problem named by its exception."""
    try:
        tokens = hit.tokens
        if not isinstance(tokens, Sequence) or isinstance(tokens, _TEXT):
            return f"the tokens are a {type(tokens).__name__}, not a sequence of ints"
        needed = max(needed, hit.hit_tokens)
        if len(tokens) < needed:
            return f"{len(tokens)} tokens for a hit that needs {needed}"
        head = tokens[:needed]
        strangers = {type(t) for t in head} - {int}
        if strangers:
            return "token ids of type " + ", ".join(sorted(t.__name__ for t in strangers))
        if head and not (min(head) >= 0 and max(head) <= MAX_TOKEN_ID):
            return f"token ids outside [0, {MAX_TOKEN_ID}]"
    except Exception as exc:  # a hostile sequence's __len__/__getitem__/__iter__ raised
        return f"reading the tokens raised {type(exc).__name__}"
    return None


def tokens_hash(tokens: Sequence[int]) -> int:
    """One block's own token hash (no chain): what the store hook computes on the engine's
    thread, so the block's tokens may change after the hook returns."""
    return hash(tuple(tokens))


def token_digest(parent: int | None, tokens: Sequence[int], own: int | None = None) -> int:
    """Digest of one block's tokens chained on its parent's digest (``None``: first block);
    ``own`` is :func:`tokens_hash` of ``tokens`` where it is already known.

    CPython's tuple hash (xxHash-style mixing, done in C; deterministic for ints, which are
    not salted): on the engine's store hook this costs a tuple copy of the block's tokens
    instead of a Python-level hash of their bytes. 64 bits is ample to tell a hit's tokens
    from the stored ones (the sidecar checks an engine's honesty, not an adversary's
    collisions); the engine's own key hash stays its business.
    """
    return hash((ROOT_DIGEST if parent is None else parent,
                 tokens_hash(tokens) if own is None else own))


def prefix_digest(tokens: Sequence[int], block_size: int) -> int | None:
    """The chained digest of ``tokens`` (whole blocks), as :class:`StoredBlock` takes it in
    ``prefix_digest`` for the block that follows them; ``None`` for an empty prefix."""
    digest: int | None = None
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        digest = token_digest(digest, tokens[start:start + block_size])
    return digest


class StoreRecord(NamedTuple):
    """What the monitor remembers of a stored block (bounded LRU, see Monitor).

    ``epoch`` is the sidecar's own count of store/free events seen for the block id (see
    :mod:`sidecar.core.store_index`): a different epoch later means the block was freed or
    stored again since, whatever stamps the engine keeps.
    """

    generation: int
    digest: int  # chained token digest, valid only when ``chained``
    chained: bool
    prefix_tokens: int
    key_fields: Mapping[str, str]
    kv_digest: str | None = None
    epoch: int = 0
    write_path: str = "all"  # the engine's write path (core.protocol.WritePath) at store


def hit_digests(hit: Hit, block_size: int, upto_index: int) -> list[int]:
    """Chained token digests of the hit's blocks ``0..upto_index``."""
    out: list[int] = []
    parent: int | None = None
    for i in range(upto_index + 1):
        parent = token_digest(parent, hit.tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def generation_at_hit(hit: Hit, ref: BlockRef) -> int | None:
    """The allocation generation the hit claims for ``ref``'s block, if it gives one."""
    gens = hit.generations.get(ref.group_id)
    return int(gens[ref.index]) if gens is not None and ref.index < len(gens) else None


def check_keys(hit: Hit, ref: BlockRef, record: StoreRecord | None, block_size: int,
               generation_at_hit: int | None, digests: Sequence[int]) -> list[Finding]:
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
