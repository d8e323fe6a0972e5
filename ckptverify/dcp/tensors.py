"""Turning stored bytes into tensors without ``torch.load``: the dtype by its stable name, and the bound on
how many bytes are materialised at once.

A tensor payload is the raw little-endian bytes of its storage; the description of a checkpoint
(:mod:`ckptverify.formats.describe`, :mod:`ckptverify.formats.dcp`) knows its byte range, dtype, shape,
strides and storage offset (read by an allowlist that executes nothing), and rebuilds it from those bytes
with ``torch.frombuffer``, in blocks of at most :data:`BLOCK_BYTES`. Nothing is unpickled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptverify.errors import FindingError

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_BYTES", "torch_dtype"]

#: Upper bound on the bytes materialised at once when streaming a chunk.
BLOCK_BYTES = 64 << 20


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a stable dtype name (``"bfloat16"``); :class:`FindingError` when this torch has
    none of that name."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise FindingError(f"this torch has no dtype {name!r}")
    return dtype
