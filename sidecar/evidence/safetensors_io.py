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

from sidecar.core.tensor_bytes import byte_view

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
MAX_TENSORS = 2**16  # tensors in one file (evidence holds 4 per condemned block)
MAX_EXTENT = 2**40  # product of a shape's dimensions (0 counted as 1): strides fit int64


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""



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
        raw = bytes(byte_view(t))  # the one byte view (sidecar.core.tensor_bytes)
        header[name] = {"dtype": DTYPES[t.dtype][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def loads(data: bytes | bytearray) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; :class:`SafetensorsError` when the
    bytes are truncated or the header is inconsistent (a file cut by a crash reads as bad,
    never as a shorter tensor). The whole header is checked (names, dtypes, shapes,
    offsets tiling the body, metadata of strings) before a tensor is built, so a crafted
    file costs no more memory than its own bytes. A ``bytearray`` is handed over: the
    tensors are views of it (the file is in memory once); ``bytes`` are copied, a tensor
    at a time."""
    if len(data) < 8:
        raise SafetensorsError("shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", data)
    if n > MAX_HEADER or 8 + n > len(data):
        raise SafetensorsError(f"header length {n} does not fit a {len(data)}-byte file")
    try:
        header = json.loads(data[8:8 + n])
    except RecursionError:
        raise SafetensorsError("header is JSON nested too deep") from None
    except ValueError as exc:
        raise SafetensorsError(f"header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    if len(header) > MAX_TENSORS + 1:
        raise SafetensorsError(f"{len(header)} tensors, over the limit of {MAX_TENSORS}")
    body = memoryview(data)[8 + n:]
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str)
                                                 for v in metadata.values()):
        raise SafetensorsError("__metadata__ is not an object of strings")
    specs = {name: _entry(name, spec, len(body)) for name, spec in header.items()}
    offset = 0
    for name, (_, _, begin, end) in sorted(specs.items(), key=lambda kv: kv[1][2:]):
        if begin != offset:
            raise SafetensorsError(f"{name[:80]!r}: data starts at {begin}, expected "
                                   f"{offset} (tensors must tile the body)")
        offset = end
    if offset != len(body):
        raise SafetensorsError(f"body is {len(body)} bytes, tensors end at {offset}")
    out: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in specs.items():
        out[name] = _tensor(data, 8 + n + begin, 8 + n + end, dtype).reshape(shape)
    return out, dict(metadata)


def _tensor(data: bytes | bytearray, begin: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """``data[begin:end]`` as a flat tensor of ``dtype``: a view of a ``bytearray`` whose
    offset suits the dtype's width, else a copy of those bytes."""
    if begin == end:
        return torch.empty(0, dtype=dtype)
    width = torch.empty(0, dtype=dtype).element_size()
    if isinstance(data, bytearray) and begin % width == 0:
        flat = torch.frombuffer(data, dtype=torch.uint8, offset=begin, count=end - begin)
    else:  # bytes are read-only, and an odd offset cannot be viewed as a wider type
        flat = torch.frombuffer(bytearray(memoryview(data)[begin:end]), dtype=torch.uint8)
    if dtype == torch.bool:
        return flat.view(torch.bool)
    return flat.view(DTYPES[dtype][1]).view(dtype)


def _entry(name: str, spec: object, body_len: int) -> tuple[torch.dtype, list[int], int, int]:
    """One header entry, checked: a known dtype, a shape of non-negative integers whose
    byte size fits the body, and offsets that hold exactly that many bytes."""
    where = f"{name[:80]!r}"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"{where}: header entry is not "
                               "{dtype, shape, data_offsets}")
    if not isinstance(spec["dtype"], str) or spec["dtype"] not in _BY_NAME:
        raise SafetensorsError(f"{where}: unsupported dtype {str(spec['dtype'])[:20]!r} "
                               f"(known: {', '.join(sorted(_BY_NAME))})")
    dtype = _BY_NAME[spec["dtype"]][0]
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or len(shape) > 8 or not all(_uint(d) for d in shape):
        raise SafetensorsError(f"{where}: shape is not a list of at most 8 integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_uint(x) for x in offsets):
        raise SafetensorsError(f"{where}: data_offsets is not two integers >= 0")
    begin, end = offsets
    size, extent = torch.empty(0, dtype=dtype).element_size(), 1
    for d in shape:  # stop as soon as a product passes its bound: no huge products
        size *= d
        extent *= max(d, 1)  # an empty tensor's strides still multiply its other dims
        if size > body_len or extent > MAX_EXTENT:
            raise SafetensorsError(f"{where}: shape {shape[:8]} does not fit a "
                                   f"{body_len}-byte body")
    if not begin <= end <= body_len or end - begin != size:
        raise SafetensorsError(f"{where}: offsets {begin}..{end} do not match shape "
                               f"{shape} {spec['dtype']} in a {body_len}-byte body")
    return dtype, list(shape), begin, end


def _uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
