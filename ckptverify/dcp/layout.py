"""ckptverify's own model of a DCP checkpoint's layout: plain data, no torch, no pickle.

The safe metadata reader (:mod:`ckptverify.dcp.metadata`) turns DCP's ``.metadata`` into these types
after validating every field, so the checks never touch DCP's private classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

#: Bytes per element for every dtype torch can save, by the name torch gives the dtype.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "uint1": 1, "uint2": 1, "uint3": 1, "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1,
    "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
    "bool": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}  # fmt: skip


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

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]


ItemKind = Literal["tensor", "bytes"]


@dataclass(frozen=True, slots=True)
class Item:
    """One stored item: a byte range ``[offset, offset + length)`` of ``file`` holding one value.

    For a tensor chunk, ``chunk`` is the box it covers; for a non-tensor value it is ``None``.
    ``transforms`` lists the stream transforms (compression, ...) applied on write, if any.
    ``source`` is the metadata file that listed the item (``.metadata`` or ``__N.metadata``).
    """

    fqn: str
    kind: ItemKind
    file: str
    offset: int
    length: int
    chunk: Chunk | None = None
    dtype: str | None = None
    transforms: tuple[str, ...] = ()
    source: str = ".metadata"
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
    save_id: str | None = None
    #: True when DCP wrote one metadata file per rank (``use_collectives=False``).
    per_rank: bool = False

    @property
    def files(self) -> list[str]:
        """Storage files referenced by at least one item, sorted."""
        return sorted({item.file for item in self.items})
