"""The safetensors file format, written and read with the standard library and torch.

Evidence keeps the cached and recomputed KV of an offending block in a file any ML tool can
open (``safetensors.torch.load_file``, ``huggingface`` viewers, numpy). The format is small
and fixed (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
a JSON header mapping each tensor name to ``{"dtype", "shape", "data_offsets"}`` (plus an
optional ``"__metadata__"`` of strings), then the raw little-endian bytes. Writing it here
keeps the lean runtime free of another dependency; torch cannot write it natively.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch

# torch dtype <-> safetensors dtype name, and the integer view used to move the raw bytes
# (numpy has no bfloat16, so every tensor's bytes go through a same-width integer view).
DTYPES: dict[torch.dtype, tuple[str, torch.dtype]] = {
    torch.float64: ("F64", torch.int64),
    torch.float32: ("F32", torch.int32),
    torch.float16: ("F16", torch.int16),
    torch.bfloat16: ("BF16", torch.int16),
    torch.int64: ("I64", torch.int64),
    torch.int32: ("I32", torch.int32),
    torch.int16: ("I16", torch.int16),
    torch.int8: ("I8", torch.int8),
    torch.uint8: ("U8", torch.uint8),
    torch.bool: ("BOOL", torch.uint8),
}
_BY_NAME = {name: (dtype, view) for dtype, (name, view) in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the format's own limit on the JSON header


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""


def _raw(t: torch.Tensor) -> bytes:
    _, view = DTYPES[t.dtype]
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bool \
        else flat.view(view).numpy().tobytes()


def dumps(tensors: Mapping[str, torch.Tensor],
          metadata: Mapping[str, str] | None = None) -> bytes:
    """``tensors`` as one safetensors file (names sorted, header padded to 8 bytes)."""
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise TypeError(f"safetensors: unsupported dtype {t.dtype} for {name!r}")
        raw = _raw(t)
        header[name] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def loads(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; :class:`SafetensorsError` when the
    bytes are truncated or the header is inconsistent (a file cut by a crash reads as bad,
    never as a shorter tensor)."""
    if len(data) < 8:
        raise SafetensorsError("shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", data)
    if n > MAX_HEADER or 8 + n > len(data):
        raise SafetensorsError(f"header length {n} does not fit a {len(data)}-byte file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as exc:
        raise SafetensorsError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    body = memoryview(data)[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    out: dict[str, torch.Tensor] = {}
    end_max = 0
    for name, spec in header.items():
        try:
            dtype, view = _BY_NAME[spec["dtype"]]
            shape = [int(d) for d in spec["shape"]]
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"bad header entry for {name!r}: {spec!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= len(body) \
                or end - begin != numel * torch.empty(0, dtype=dtype).element_size():
            raise SafetensorsError(f"{name!r}: offsets {begin}..{end} do not match shape "
                                   f"{shape} {spec['dtype']} in a {len(body)}-byte body")
        end_max = max(end_max, end)
        chunk = bytes(body[begin:end])
        flat = torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if chunk \
            else torch.empty(0, dtype=torch.uint8)
        t = flat.view(torch.bool if dtype == torch.bool else view)
        out[name] = (t if dtype == torch.bool else t.view(dtype)).reshape(shape)
    if end_max != len(body):
        raise SafetensorsError(f"body is {len(body)} bytes, tensors end at {end_max}")
    return out, {str(k): str(v) for k, v in dict(metadata).items()}
