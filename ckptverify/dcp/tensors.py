"""Turning stored bytes into tensors without ``torch.load`` or unpickling: the dtype by stable name, and the bound
(:data:`BLOCK_BYTES`) on bytes materialised at once by ``torch.frombuffer``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptverify.errors import FindingError

if TYPE_CHECKING:
    import torch

__all__ = ["BLOCK_BYTES", "torch_dtype"]

#: Upper bound on the bytes materialised at once when streaming a chunk.
BLOCK_BYTES = 64 << 20


def torch_dtype(name: str, error: type[Exception] = FindingError) -> torch.dtype:
    """The torch dtype named ``name``; ``error`` if this torch has none."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise error(f"this torch has no dtype {name!r}")
    return dtype
