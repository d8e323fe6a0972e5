"""ckptverify's own model of a DCP checkpoint's layout: plain data, no torch, no pickle. Built by
:mod:`ckptverify.dcp.metadata` from validated fields, so the checks never touch DCP's private classes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

# The dtype table is the readers' (the lowest layer), named here with the layout whose dtypes it sizes.
from ckptverify.safeparse.dtypes import DTYPE_ITEMSIZE

__all__ = ["DTYPE_ITEMSIZE", "Chunk", "Item", "ItemKind", "Layout", "TensorInfo"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """A box inside a tensor's global shape: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor of the saved state dict: global dtype and shape, and the chunks it was saved as."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


ItemKind = Literal["tensor", "bytes"]


@dataclass(frozen=True, slots=True)
class Item:
    """One stored item: bytes ``[offset, offset + length)`` of ``file``. ``chunk``: the box a tensor chunk covers
    (``None`` for a non-tensor); ``transforms``: stream transforms applied on write; ``rank``: of the per-rank
    metadata file that listed it."""

    fqn: str
    kind: ItemKind
    file: str
    offset: int
    length: int
    chunk: Chunk | None = None
    dtype: str | None = None
    transforms: tuple[str, ...] = ()
    rank: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True)
class Layout:
    """Everything the metadata says about a checkpoint, merged over all metadata files."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    byte_values: set[str] = field(default_factory=set)
    items: list[Item] = field(default_factory=list)
    metadata_files: list[str] = field(default_factory=list)
    dcp_version: str | None = None
    #: True when DCP wrote one metadata file per rank (``use_collectives=False``).
    per_rank: bool = False

    @property
    def files(self) -> list[str]:
        """Storage files referenced by at least one item, sorted."""
        return sorted({item.file for item in self.items})
