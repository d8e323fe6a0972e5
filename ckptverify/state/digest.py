"""State digests: one stable hex digest of any DCP-saveable value (nested dicts, lists, tensors, scalars).

Used to prove that a restored field equals the saved one without keeping a copy: the digest depends only on
values (dtypes, shapes, bytes, types of scalars, dict keys sorted), not on strides, devices or dict order.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import xxhash

from ckptverify.errors import UsageError


def _walk(obj: Any, h: Any) -> None:
    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "full_tensor"):  # DTensor: the global value
            obj = obj.full_tensor()
        t = obj.detach().cpu().contiguous()
        dtype = str(t.dtype).encode()
        h.update(b"T" + struct.pack("<I", len(dtype)) + dtype + struct.pack("<I", t.dim()))
        h.update(b"".join(struct.pack("<q", s) for s in t.shape))
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        _walk(torch.from_numpy(np.ascontiguousarray(obj)), h)
    elif isinstance(obj, bool | np.bool_):
        h.update(b"B1" if obj else b"B0")
    elif isinstance(obj, int | np.integer):
        raw = str(int(obj)).encode()
        h.update(b"I" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(obj, float | np.floating):
        h.update(b"F" + struct.pack("<d", float(obj)))
    elif isinstance(obj, str):
        raw = obj.encode()
        h.update(b"S" + struct.pack("<Q", len(raw)) + raw)
    elif isinstance(obj, bytes | bytearray):
        h.update(b"Y" + struct.pack("<Q", len(obj)) + bytes(obj))
    elif obj is None:
        h.update(b"N")
    elif isinstance(obj, Mapping):
        h.update(b"D" + struct.pack("<Q", len(obj)))
        for key in sorted(obj, key=str):
            _walk(str(key), h)
            _walk(obj[key], h)
    elif isinstance(obj, list | tuple):
        h.update(b"L" + struct.pack("<Q", len(obj)))
        for item in obj:
            _walk(item, h)
    else:
        # Opaque objects (e.g. a scheduler's lambda): their type is all that can be compared.
        name = f"{type(obj).__module__}.{type(obj).__qualname__}".encode()
        h.update(b"O" + struct.pack("<I", len(name)) + name)


def state_digest(obj: Any) -> str:
    """xxh3-128 hex digest of ``obj``'s canonical serialization."""
    h = xxhash.xxh3_128()
    try:
        _walk(obj, h)
    except RecursionError:
        raise UsageError("state is nested too deeply to digest") from None
    return h.hexdigest()
