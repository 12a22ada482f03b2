"""The verifier's first stage: is each sampled block the one this hit needs, by identity
alone (no adapter call, no bytes read)?

Key consistency (:mod:`sidecar.checks.keys`: generation, token digest, key fields recorded
at store vs at hit; a record stored one block off or at an earlier boundary is named by
:func:`sidecar.checks.hybrid.misplaced`) and, per cache group, coverage
(:mod:`sidecar.checks.coverage`: every group holds real, loaded state where it must). Blocks
condemned here are never read or recomputed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sidecar.checks.base import Finding
from sidecar.checks.coverage import check_coverage
from sidecar.checks.hybrid import misplaced
from sidecar.checks.keys import StoreRecord, check_keys, generation_at_hit, hit_digests
from sidecar.core.protocol import BlockRef, CacheGroup, EngineInfo, Hit


def check_identity(hit: Hit, refs: Sequence[BlockRef],
                   records: Mapping[BlockRef, StoreRecord | None], info: EngineInfo,
                   groups: Mapping[int, CacheGroup]) -> tuple[list[Finding], set[BlockRef]]:
    """The findings of the key and coverage checks, and the refs they condemn."""
    bs = info.block_size
    digests = hit_digests(hit, bs, max(r.index for r in refs))
    findings: list[Finding] = []
    condemned: set[BlockRef] = set()
    for ref in refs:
        record = records.get(ref)
        found = check_keys(hit, ref, record, bs, generation_at_hit(hit, ref), digests)
        if found and record is not None:  # stored one block off / an earlier boundary
            group = groups.get(ref.group_id)
            found = [misplaced(group, ref, record.prefix_tokens, bs, f) for f in found]
        if found:
            condemned.add(ref)
            findings.extend(found)
    coverage = check_coverage(hit, info)
    if coverage:  # a chosen block at a position the coverage check condemned
        findings.extend(coverage)
        at = {(f.group_id, f.block_index) for f in coverage}
        condemned.update(r for r in refs if (r.group_id, r.index) in at)
    return findings, condemned
