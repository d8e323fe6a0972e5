"""DCP's safetensors serialization: non-tensor items as ``torch.save`` archives, then one safetensors blob per file
(8-byte header length, JSON header with ``data_offsets``, tensor bytes). The metadata points every tensor at the
blob's start, so the blob is checked as a unit. It carries no checksums."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ckptverify.dcp.layout import DTYPE_ITEMSIZE
from ckptverify.errors import ArchiveError, JSONError
from ckptverify.safeparse import safejson
from ckptverify.safeparse.dtypes import contiguous_strides
from ckptverify.safeparse.readers import ReadOnlyFile
from ckptverify.safeparse.torchsave import TensorHeader
from ckptverify.safeparse.zipwalk import Archive, Record

MAX_HEADER_BYTES = 100 << 20
#: Most dimensions of one tensor (torch allows 64).
MAX_DIMS = 64
#: Largest dimension, offset and byte count accepted (a signed 64-bit integer, as the format's Rust reader).
MAX_INT = (1 << 63) - 1

_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class BlobTensor:
    dtype: str | None
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Blob:
    start: int
    data_start: int
    end: int
    tensors: dict[str, BlobTensor]


def read_blob(f: ReadOnlyFile, start: int) -> Blob:
    """Parse and check the safetensors blob at ``start``: header, tensor ranges tiling the data, length."""
    head = f.pread(start, 8)
    if len(head) != 8:
        raise ArchiveError("safetensors header length is cut short", start, start + 8)
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or start + 8 + n > f.size:
        raise ArchiveError(f"safetensors header claims {n} bytes, past the end of the file", start, start + 8)
    try:
        header = safejson.loads(f.pread(start + 8, n), max_bytes=MAX_HEADER_BYTES)
    except JSONError as exc:
        raise ArchiveError(f"safetensors header is not valid JSON: {exc}", start + 8, start + 8 + n) from None
    if not isinstance(header, dict):
        raise ArchiveError("safetensors header is not a JSON object", start + 8, start + 8 + n)
    data_start = start + 8 + n
    tensors: dict[str, BlobTensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, begin, end, dtype = _entry(spec)
        except JSONError as exc:
            raise ArchiveError(f"safetensors entry {name[:200]!r} is malformed: {exc}", start + 8, data_start) from None
        if end < begin:
            raise ArchiveError(f"safetensors entry {name[:200]!r} has an invalid range", start + 8, data_start)
        if dtype is not None and end - begin != math.prod(shape) * DTYPE_ITEMSIZE[dtype]:
            raise ArchiveError(f"safetensors entry {name[:200]!r}: {end - begin} bytes for {dtype}{list(shape)}",
                            data_start + begin, data_start + end)
        tensors[name] = BlobTensor(dtype, shape, begin, end)
    cursor = 0
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].begin):
        if t.begin != cursor:
            raise ArchiveError(f"safetensors entry {name!r} does not start where the previous one ended",
                            data_start + min(cursor, t.begin), data_start + max(cursor, t.begin))
        cursor = t.end
    end = data_start + cursor
    if end > f.size:
        raise ArchiveError(f"safetensors data ends at byte {end} but the file has only {f.size} bytes",
                        f.size, end)
    return Blob(start, data_start, end, tensors)


def _entry(spec: object) -> tuple[tuple[int, ...], int, int, str | None]:
    """Shape, data offsets and dtype (``None``: unknown) of one header entry: exact integers within :data:`MAX_INT`, at
    most :data:`MAX_DIMS` dimensions."""
    if not isinstance(spec, dict):
        raise JSONError("the entry is not an object")
    raw_shape, offsets, dtype = spec.get("shape"), spec.get("data_offsets"), spec.get("dtype")
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_DIMS:
        raise JSONError(f"shape is not a list of at most {MAX_DIMS} dimensions")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise JSONError("data_offsets is not a list of two offsets")
    if not isinstance(dtype, str):
        raise JSONError("dtype is not a string")
    shape = tuple(safejson.exact_int(x, "a dimension", hi=MAX_INT) for x in raw_shape)
    begin, end = (safejson.exact_int(x, "a data offset", hi=MAX_INT) for x in offsets)
    return shape, begin, end, _DTYPES.get(dtype)


def data_range(blob: Blob, name: str) -> tuple[int, int] | None:
    """``(offset, length)`` in the file of tensor ``name`` in ``blob`` (from the blob header), or ``None``."""
    t = blob.tensors.get(name)
    return None if t is None else (blob.data_start + t.begin, t.end - t.begin)


def raw_payload(dtype: str, shape: tuple[int, ...], length: int) -> tuple[Archive, TensorHeader]:
    """A raw payload as the one-record archive (``data/0``) and contiguous header the tensor readers take. It carries
    no CRC-32: never hand it to a CRC check."""
    record = Record(name="payload/data/0", header_offset=0, data_offset=0, size=length, crc=0)
    header = TensorHeader(dtype=dtype, storage_key="0", storage_numel=math.prod(shape), storage_offset=0,
                          size=tuple(shape), stride=contiguous_strides(shape))
    return Archive(records=(record,), prefix="payload"), header
