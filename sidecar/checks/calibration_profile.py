"""A calibration profile: the noise floors measured on a trusted engine, kept across restarts.

A sidecar that learns its tolerance in memory learns it again after every restart, from
whatever state the engine is in then: restarted beside an engine that silently round-trips
KV through fp8, it learns the fault's error as "noise" and the check goes blind (the fp8
downcast in bfloat16 was caught 96/96 after a clean calibration, 3/152 otherwise). A profile
is what the trusted run measured, written once by ``kv-sidecar calibrate`` and loaded at
every start (``SidecarConfig.calibration_profile``); the sidecar may tighten under it, never
loosen past it (:mod:`sidecar.checks.calibration`).

One entry per **model, dtype, KV storage, reference kind and write path** (``"all"``: the
engine does not say whether prefill or decode wrote a block). The file is small JSON::

    {"format": "kv-sidecar-calibration/1",
     "entries": [{"engine": "reference", "model": "tiny-llama", "dtype": "bfloat16",
                  "kv_storage": null, "reference": "engine", "write_path": "all",
                  "floor": 0.0256, "tolerance": 0.102, "multiple": 4.0, "blocks": 5238}]}

An entry also names the **kernels** it was measured on (:func:`host_kernels`: torch's CPU
capability, AMX, the GPU). Exactness does not travel: a floor of exactly 0 measured where
bf16 prefills were bit-reproducible is a hypothesis on a machine whose kernels differ (with
AMX, oneDNN's bf16 matmuls depend on the shapes: the reference engine's prefill recompute
then differs from its write by up to 0.008 in about 0.1% of blocks). Such an entry is
compared exactly only where ``kernels`` match; elsewhere exactness is learnt and refutable
like a path without a profile. One file may hold the same key measured on several kernels
(:attr:`ProfileEntry.slot`); :meth:`Profile.find` takes the one measured here, else one that
does not say (written before ``kernels`` existed), else any. The reference engines' shipped
profile holds both: without AMX (no ``kernels``) and with it (``cpu:avx512+amx``).

It is read like any file from outside: size-capped, every field type-checked, every number
finite and in range, unknown dtypes, reference kinds and fields refused with the entry named
(:class:`ProfileError`, raised at start — never in a hook).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import unicodedata
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from sidecar.checks.tolerance import (
    REFERENCE_KINDS,
    STORAGE_TOLERANCES,
    TOLERANCES,
)
from sidecar.config.toml_file import (
    FileMissing,
    FileProblem,
    json_object_once,
    read_small_file,
)
from sidecar.core.protocol import WritePath

PROFILE_FORMAT = "kv-sidecar-calibration/1"
MAX_PROFILE_BYTES = 1 << 20  # a profile of a few hundred entries is ~100 KiB
MAX_ENTRIES = 4096
MAX_NAME = 256  # characters of an engine or model name
# (reference kind, write path) pairs whose clean floor may be exactly 0: the engine's own
# salted prefill against a block a prefill wrote (same kernels, same batch shape on CPU).
# A decode-written block is recomputed by a prefill: different kernels, never exact.
EXACT_PATHS = frozenset({("engine", WritePath.PREFILL.value)})
# Blocks a floor of exactly 0 should be measured over before it is relied on: with AMX the
# reference engine's bf16 prefills differ in about 1 of 700 blocks, and a calibration of
# 120 requests (1,004 prefill blocks) measured 0 where 130 found 0.008 (an outside check).
EXACT_EVIDENCE_BLOCKS = 2000
MAX_MULTIPLE = 1000.0
MAX_BLOCKS = 1 << 53
# Clean blocks an entry must be measured over for its exactness (floor 0) or near-exactness
# to be trusted from the first block: four times the window a sidecar learns from by
# default (64), under what a trusted vLLM run gives (299-480 prefill blocks per model) and
# the reference engines' shipped entries (1,694-1,921). `kv-sidecar calibrate` writes
# entries from 64 blocks on, and an entry a hand wrote with a floor of 1e-30 over one block
# turned AMX's rare re-roundings into alarms (an outside check).
TRUSTED_BLOCKS = 256
WRITE_PATHS = tuple(p.value for p in WritePath)  # the one list: core.protocol


class ProfileError(ValueError):
    """A calibration profile that cannot be used (the message names the file and field)."""


@dataclass(frozen=True)
class ProfileEntry:
    """The noise floor of one (model, dtype, KV storage, reference kind, write path)."""

    model: str
    dtype: str
    reference: str
    floor: float  # largest error of a clean block seen
    tolerance: float  # the tolerance the trusted run settled on (multiple x floor, clamped)
    blocks: int  # clean blocks the floor was measured over
    multiple: float = 4.0
    write_path: str = "all"
    kv_storage: str | None = None
    engine: str = ""
    kernels: str = ""  # host_kernels() of the trusted run; "" = not recorded

    @property
    def measured_here(self) -> bool:
        """Measured on the kernels this process runs on (:func:`host_kernels`), over
        enough blocks (:data:`TRUSTED_BLOCKS`) for its floor to be trusted from the start."""
        return self.kernels == host_kernels() and self.blocks >= TRUSTED_BLOCKS

    @property
    def exact_here(self) -> bool:
        """A floor of exactly 0 over :data:`TRUSTED_BLOCKS` blocks or more, measured on the
        kernels this process runs on (or not saying on which: an entry written before
        ``kernels`` existed is trusted as it was)."""
        return self.floor == 0.0 and self.blocks >= TRUSTED_BLOCKS and (
            self.measured_here or not self.kernels)

    @property
    def key(self) -> tuple[str, str, str | None, str, str]:
        return self.model, self.dtype, self.kv_storage, self.reference, self.write_path

    @property
    def slot(self) -> tuple[str, str, str | None, str, str, str]:
        """What one entry of a file stands for: its key on its kernels (a file may hold one
        measurement per kernels for the same key: with AMX and without)."""
        return (*self.key, self.kernels)

    def describe(self) -> str:
        """One line for a person: what was measured, over how much, and what it gives (the
        line `kv-sidecar calibrate` and `vllm serve --write-profile` print per entry): on
        an exact path, the compare in force on these kernels (exact, or near-exact at
        ``multiple`` x floor), and a caution where a floor of 0 rests on fewer than
        :data:`EXACT_EVIDENCE_BLOCKS` blocks."""
        line = (f"{self.model} {self.dtype} {self.reference} {self.write_path}: floor "
                f"{self.floor:.3g} over {self.blocks} clean blocks -> tolerance "
                f"{self.tolerance:.3g}")
        if (self.reference, self.write_path) not in EXACT_PATHS:
            return line
        if self.blocks < TRUSTED_BLOCKS:
            return line + f" (not trusted exact: under {TRUSTED_BLOCKS} blocks)"
        if self.floor == 0.0:
            line += " (compared bit for bit on these kernels"
            if self.blocks < EXACT_EVIDENCE_BLOCKS:
                line += (f"; caution: exact over only {self.blocks} blocks, with AMX a "
                         "prefill re-rounds about 1 block in 700: measure over "
                         f"{EXACT_EVIDENCE_BLOCKS}+ before relying on it")
            return line + ")"
        if near_exact_tolerance(self) < self.tolerance:
            line += f" (compared near-exactly at {near_exact_tolerance(self):.3g} here)"
        return line


def near_exact_tolerance(entry: ProfileEntry) -> float:
    """The tolerance of an exact path whose engine is *nearly* exact on these kernels: a
    floor above 0 measured on them (:attr:`ProfileEntry.measured_here`) is a rare re-rounding
    (with AMX, oneDNN's bf16 matmuls depend on the shapes: 7 of 5,154 clean prefill blocks of
    the reference engine differ, by one ulp of a few elements, 0.008), not a noisy reference.
    The trusted run measured it over thousands of blocks, so its ``multiple`` x floor holds
    without the few-ulps minimum that guards a floor learnt from 64 blocks; the minimum
    (0.0625 in bfloat16) would hide a constant offset of 0.05 that changes outputs."""
    return entry.multiple * entry.floor


@dataclass(frozen=True)
class Profile:
    """Every entry of one profile file, looked up by :meth:`find`."""

    entries: tuple[ProfileEntry, ...]
    source: str = ""

    def find(self, model: str, dtype: str, kv_storage: str | None, reference: str,
             write_path: str = "all") -> ProfileEntry | None:
        """The entry for the key measured on this process's kernels; else one that does not
        say on which (written before ``kernels`` existed); else one measured elsewhere (its
        tolerance holds, its exactness does not: :attr:`ProfileEntry.exact_here`)."""
        key = (model, dtype.removeprefix("torch."), kv_storage, reference, write_path)
        found = [e for e in self.entries if e.key == key]
        for fits in (lambda e: e.measured_here, lambda e: not e.kernels, lambda e: True):
            for entry in found:
                if fits(entry):
                    return entry
        return None

    def merged(self, newer: Profile) -> Profile:
        """This profile with ``newer``'s entries replacing those of the same key measured on
        the same kernels (a measurement on other kernels is kept beside them)."""
        keep = {e.slot: e for e in self.entries}
        keep.update({e.slot: e for e in newer.entries})
        return Profile(tuple(keep.values()), newer.source or self.source)

    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT,
                           "entries": [asdict(e) for e in self.entries]}, indent=1) + "\n"


_FIELDS: dict[str, tuple[type, ...]] = {
    "engine": (str,), "model": (str,), "dtype": (str,), "reference": (str,),
    "write_path": (str,), "kv_storage": (str, type(None)), "floor": (int, float),
    "tolerance": (int, float), "multiple": (int, float), "blocks": (int,), "kernels": (str,)}
_REQUIRED = ("model", "dtype", "reference", "floor", "tolerance", "blocks")


def parse_profile(data: bytes, source: str = "<profile>") -> Profile:
    """A profile from the bytes of its file; :class:`ProfileError` for anything off."""
    if len(data) > MAX_PROFILE_BYTES:
        raise ProfileError(f"calibration profile {source}: {len(data)} bytes, over the "
                           f"{MAX_PROFILE_BYTES}-byte limit")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                         object_pairs_hook=json_object_once)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise ProfileError(f"calibration profile {source}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"calibration profile {source}: expected an object with "
                           f'"format": "{PROFILE_FORMAT}"')
    extra = set(doc) - {"format", "entries"}
    if extra:
        raise ProfileError(f"calibration profile {source}: unknown keys {sorted(extra)}")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise ProfileError(f"calibration profile {source}: \"entries\" must be a list")
    if len(raw) > MAX_ENTRIES:
        raise ProfileError(f"calibration profile {source}: {len(raw)} entries, over "
                           f"{MAX_ENTRIES}")
    entries: dict[tuple[str, str, str | None, str, str, str], tuple[int, ProfileEntry]] = {}
    for i, item in enumerate(raw):
        entry = _entry(item, f"calibration profile {source}: entry {i}")
        if entry.slot in entries:
            unsaid = [f for f in ("kernels", "write_path", "kv_storage", "engine")
                      if f not in item]
            hint = f" (it does not give {', '.join(unsaid)}: the default is taken)" \
                if unsaid else ""
            raise ProfileError(f"calibration profile {source}: entry {i} repeats entry "
                               f"{entries[entry.slot][0]}: the same model, dtype, KV "
                               f"storage, reference, write path and kernels{hint}")
        entries[entry.slot] = (i, entry)
    return Profile(tuple(e for _, e in entries.values()), source)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _entry(item: Any, where: str) -> ProfileEntry:
    if not isinstance(item, dict):
        raise ProfileError(f"{where}: expected an object")
    unknown = set(item) - set(_FIELDS)
    if unknown:
        raise ProfileError(f"{where}: unknown fields {sorted(unknown)}")
    missing = [f for f in _REQUIRED if f not in item]
    if missing:
        raise ProfileError(f"{where}: missing {missing}")
    for name, value in item.items():
        types = _FIELDS[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ProfileError(f"{where}: {name} has the wrong type ({type(value).__name__})")
        if isinstance(value, str) and not 0 < len(value) <= MAX_NAME and \
                name not in ("engine", "kernels"):
            raise ProfileError(f"{where}: {name} must be 1..{MAX_NAME} characters")
    fields: dict[str, Any] = {k: float(v) if k in ("floor", "tolerance", "multiple") else v
                              for k, v in item.items()}
    entry = ProfileEntry(**fields)
    if entry.dtype not in TOLERANCES:
        raise ProfileError(f"{where}: unknown dtype {entry.dtype!r}; known: "
                           f"{', '.join(sorted(TOLERANCES))}")
    if entry.reference not in REFERENCE_KINDS:
        raise ProfileError(f"{where}: unknown reference kind {entry.reference!r}; known: "
                           f"{', '.join(REFERENCE_KINDS)}")
    if entry.write_path not in WRITE_PATHS:
        raise ProfileError(f"{where}: unknown write path {entry.write_path!r}; known: "
                           f"{', '.join(WRITE_PATHS)}")
    if entry.kv_storage is not None and entry.kv_storage not in STORAGE_TOLERANCES:
        raise ProfileError(f"{where}: unknown KV storage {entry.kv_storage!r}")
    for name in ("engine", "kernels"):
        if len(getattr(entry, name)) > MAX_NAME:
            raise ProfileError(f"{where}: {name} must be at most {MAX_NAME} characters")
    if not (math.isfinite(entry.floor) and entry.floor >= 0):
        raise ProfileError(f"{where}: floor must be a finite number >= 0, got {entry.floor}")
    if not (math.isfinite(entry.tolerance) and entry.tolerance > 0):
        raise ProfileError(f"{where}: tolerance must be a finite number > 0, "
                           f"got {entry.tolerance}")
    if not (math.isfinite(entry.multiple) and entry.multiple >= 1):
        raise ProfileError(f"{where}: multiple must be a finite number >= 1, "
                           f"got {entry.multiple}")
    if entry.tolerance > 1.0 or entry.tolerance < entry.floor:
        raise ProfileError(f"{where}: tolerance must be between the floor ({entry.floor}) "
                           f"and 1, got {entry.tolerance}: a trusted run's tolerance is "
                           "never under the largest clean error it saw")
    if entry.multiple > MAX_MULTIPLE:
        raise ProfileError(f"{where}: multiple must be at most {MAX_MULTIPLE}, got "
                           f"{entry.multiple}")
    if not 1 <= entry.blocks <= MAX_BLOCKS:
        raise ProfileError(f"{where}: blocks must be in 1..{MAX_BLOCKS}, got {entry.blocks}")
    for name in ("model", "engine", "kernels"):
        # control and format characters (bidi overrides, zero-width): a name is shown in
        # logs and compared as written
        if any(unicodedata.category(c) in ("Cc", "Cf") for c in getattr(entry, name)):
            raise ProfileError(f"{where}: {name} has a control or format character")
    return entry


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read and check a profile file; :class:`ProfileError` names what is wrong."""
    try:  # a device, FIFO or directory is refused before a byte is read
        data = read_small_file(path, "calibration profile", MAX_PROFILE_BYTES)
    except FileMissing:
        raise ProfileError(f"calibration profile {path}: no such file (write one with "
                           "`kv-sidecar calibrate`)") from None
    except FileProblem as exc:
        raise ProfileError(str(exc)) from None
    return parse_profile(data, str(path))


def save_profile(path: str | os.PathLike[str], profile: Profile) -> None:
    """Write ``profile`` atomically (a reader sees the old file or the new one, never half)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(profile.to_json())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@lru_cache(maxsize=1)
def host_kernels() -> str:
    """The kernels a recompute runs on in this process, as far as bit-exactness goes:
    torch's CPU capability (``avx2``, ``avx512``...), ``+amx`` where the CPU has AMX, and
    the first GPU's name where torch sees one. E.g. ``cpu:avx512+amx``. AMX counts only where
    oneDNN may use it: ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (or ``DNNL_MAX_CPU_ISA``) keeps
    oneDNN off AMX, and the reference engine's bf16 prefills are then bit-exact again (measured
    on a Sapphire Rapids CPU: 0 of 5,154 clean blocks differ; with AMX, 7)."""
    import torch

    out = f"cpu:{torch.backends.cpu.get_cpu_capability().lower()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = f.read(1 << 20)
        out += "+amx" if " amx_bf16" in flags and _onednn_may_use_amx() else ""
    except OSError:  # not Linux: the capability alone
        pass
    if torch.cuda.is_available():
        out += f" cuda:{torch.cuda.get_device_name(0)}"
    return out[:MAX_NAME]


def _onednn_may_use_amx() -> bool:
    """oneDNN's ISA cap (read once, when oneDNN starts) leaves AMX in: unset, ALL or DEFAULT,
    or an ISA whose name includes AMX."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
           or "ALL").strip().upper()
    return cap in ("ALL", "DEFAULT") or "AMX" in cap
