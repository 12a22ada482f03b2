"""Writing a calibration profile: the entries a trusted run measured, merged into a file.

One job apart from :mod:`sidecar.checks.calibration_profile` (the format, its checks and
reading it at start): ``kv-sidecar calibrate`` (the reference engines) and ``kv-sidecar
vllm serve --write-profile`` turn a run's floors into entries here and write them, the
file checked before the run starts.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sidecar.checks.calibration_profile import (
    Profile,
    ProfileEntry,
    ProfileError,
    host_kernels,
    load_profile,
    save_profile,
)
from sidecar.checks.tolerance import min_tolerance


def measured_entries(states: Iterable[Any], *, reference: str, dtype: str, model: str,
                     kv_storage: str | None, engine: str, multiple: float,
                     min_blocks: int) -> list[ProfileEntry]:
    """The profile entries a trusted run measured: one per write path with at least
    ``min_blocks`` clean blocks, and the ``all`` entry over every block (for blocks stored
    without a path). ``states`` are the run's :class:`~sidecar.checks.calibration.FloorState`
    (its tolerance held at the hard table, so nothing learnt could hide a block); those of
    other reference kinds are skipped. ``ValueError`` when fewer than ``min_blocks`` clean
    blocks were verified in all. One function for every engine: ``kv-sidecar calibrate``
    (the reference engines) and ``kv-sidecar vllm serve --write-profile``."""
    by_path = {s.write_path: s for s in states if s.reference == reference}
    total = by_path["all"].clean_blocks if "all" in by_path else 0
    if total < min_blocks:
        raise ValueError(f"only {total} clean blocks verified (at least {min_blocks} needed)")
    ceiling = by_path["all"].ceiling
    minimum = min_tolerance(dtype)
    return [ProfileEntry(model=model, dtype=dtype, reference=reference, floor=s.clean_max,
                         tolerance=min(ceiling, max(minimum, multiple * s.clean_max)),
                         blocks=s.clean_blocks, multiple=multiple, write_path=path,
                         kv_storage=kv_storage, engine=engine, kernels=host_kernels())
            for path, s in sorted(by_path.items())
            if path == "all" or s.clean_blocks >= min_blocks]


def profile_to_extend(path: str | os.PathLike[str], replace: bool, flag: str) -> Profile:
    """The profile new entries will be merged into: ``path``'s (empty when it does not exist
    yet, or when ``replace``). Called before a calibration run starts, so a path the profile
    cannot be written to (a directory, device, FIFO or socket, a missing or read-only
    directory) stops it at once, not after the run; and a regular file that is not a profile
    is never overwritten by accident (:class:`ProfileError`; ``flag`` is named as the way to
    overwrite such a file)."""
    p = Path(path)
    where = f"calibration profile {path}"
    if not str(path):
        raise ProfileError("calibration profile: an empty path")
    parent = p.parent
    if not parent.is_dir():
        raise ProfileError(f"{where}: its directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ProfileError(f"{where}: its directory {parent} is not writable")
    if not os.path.lexists(p):
        return Profile(())  # a new file
    try:
        st = p.stat()
    except OSError as exc:  # a dangling link, a loop
        raise ProfileError(f"{where} is a link that leads nowhere "
                           f"({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ProfileError(f"{where} is not a regular file (a directory, device, FIFO or "
                           "socket): the profile is written to a file")
    if replace:
        return Profile(())
    try:
        return load_profile(path)
    except ProfileError as exc:
        raise ProfileError(f"{exc} (use {flag} to overwrite it)") from None


def save_entries(path: str | os.PathLike[str], entries: Iterable[ProfileEntry],
                 base: Profile) -> int:
    """Write ``base`` with ``entries`` replacing those of the same key on the same kernels
    (atomically); the number of entries the file now holds."""
    merged = base.merged(Profile(tuple(entries), str(path)))
    save_profile(path, merged)
    return len(merged.entries)
