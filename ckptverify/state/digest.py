"""State digests: one stable hex digest of any DCP-saveable value, proving a restored field equals the saved one
without keeping a copy. It depends only on values (dtypes, shapes, bytes, scalar types, sorted keys), not strides,
devices or dict order. The serialization is part of the checkpoint format: the bytes hashed must never change."""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from typing import Any

import xxhash

from ckptverify.errors import UsageError

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")

@functools.cache
def _modules() -> tuple[Any, Any]:
    import numpy
    import torch

    return numpy, torch


def _tensor(obj: Any, h: Any, buf: bytearray) -> None:
    _, torch = _modules()
    if hasattr(obj, "full_tensor"):  # DTensor: the global value
        obj = obj.full_tensor()
    t = obj.detach().cpu().contiguous()
    dtype = str(t.dtype).encode()
    buf += b"T" + _U32.pack(len(dtype)) + dtype + _U32.pack(t.dim())
    for s in t.shape:
        buf += _I64.pack(s)
    if t.numel():
        h.update(buf)
        buf.clear()
        h.update(t.reshape(-1).view(torch.uint8).numpy())


def _walk(obj: Any, h: Any, buf: bytearray) -> None:
    kind = type(obj)
    # The exact built-in types; _walk_other gives everything else, or reduces it to them.
    if kind is float:
        buf += b"F" + _F64.pack(obj)
    elif kind is int:
        raw = str(obj).encode()
        buf += b"I" + _U32.pack(len(raw)) + raw
    elif kind is str:
        raw = obj.encode()
        buf += b"S" + _U64.pack(len(raw)) + raw
    elif kind is bool:
        buf += b"B1" if obj else b"B0"
    elif obj is None:
        buf += b"N"
    elif kind is list or kind is tuple:
        buf += b"L" + _U64.pack(len(obj))
        for item in obj:
            _walk(item, h, buf)
    elif kind is dict:
        _mapping(obj, h, buf)
    else:
        _walk_other(obj, h, buf)


def _mapping(obj: Mapping[Any, Any], h: Any, buf: bytearray) -> None:
    buf += b"D" + _U64.pack(len(obj))
    for key in sorted(obj, key=str):
        _walk(str(key), h, buf)
        _walk(obj[key], h, buf)


def _walk_other(obj: Any, h: Any, buf: bytearray) -> None:
    np, torch = _modules()
    if isinstance(obj, torch.Tensor):
        _tensor(obj, h, buf)
    elif isinstance(obj, np.ndarray):
        _tensor(torch.from_numpy(np.ascontiguousarray(obj)), h, buf)
    elif isinstance(obj, bool | np.bool_):
        _walk(bool(obj), h, buf)
    elif isinstance(obj, int | np.integer):
        _walk(int(obj), h, buf)
    elif isinstance(obj, float | np.floating):
        _walk(float(obj), h, buf)
    elif isinstance(obj, str):
        _walk(str.__str__(obj), h, buf)  # the characters, whatever a subclass's __str__ says
    elif isinstance(obj, bytes | bytearray):
        buf += b"Y" + _U64.pack(len(obj)) + bytes(obj)
    elif isinstance(obj, Mapping):
        _mapping(obj, h, buf)
    elif isinstance(obj, list | tuple):
        _walk(list(obj), h, buf)
    else:
        # Opaque objects (e.g. a scheduler's lambda): their type is all that can be compared.
        name = f"{type(obj).__module__}.{type(obj).__qualname__}".encode()
        buf += b"O" + _U32.pack(len(name)) + name


def state_digest(obj: Any) -> str:
    """xxh3-128 hex digest of ``obj``'s canonical serialization."""
    h = xxhash.xxh3_128()
    buf = bytearray()
    try:
        _walk(obj, h, buf)
    except RecursionError:
        raise UsageError("state is nested too deeply to digest") from None
    h.update(buf)
    return h.hexdigest()
