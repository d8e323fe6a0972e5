"""Materialise tensor chunks from DCP items without ``torch.load``.

A tensor item's payload is the raw little-endian bytes of its storage; :mod:`ckptverify.safeparse.zipwalk`
already told us its byte range, dtype, shape, strides and storage offset (read by an allowlist that
executes nothing). Here those bytes are turned into tensors with ``torch.frombuffer``, in bounded row
blocks so memory stays flat however large a chunk is. Nothing is unpickled.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptverify.dcp.layout import DTYPE_ITEMSIZE, Item
from ckptverify.errors import UnreadableTensor
from ckptverify.safeparse.readers import ReadOnlyFile
from ckptverify.safeparse.torchsave import TensorHeader
from ckptverify.safeparse.zipwalk import Archive

if TYPE_CHECKING:
    import torch

#: Upper bound on the bytes materialised at once when streaming a chunk.
BLOCK_BYTES = 64 << 20


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise UnreadableTensor(f"this torch has no dtype {name!r}")
    return dtype


def iter_row_blocks(f: ReadOnlyFile, item: Item, archive: Archive, header: TensorHeader,
                    max_bytes: int = BLOCK_BYTES) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """Yield ``(global_offsets, tensor)`` blocks of consecutive rows that together make up the chunk.

    Each block is itself a box of the global tensor (rows ``[r0, r1)`` of the chunk's first dimension), so
    its logical fingerprint is computed with its own global offsets and the blocks combine exactly.
    """
    import torch

    assert item.chunk is not None
    record = archive.record(f"data/{header.storage_key}")
    if record is None:
        raise UnreadableTensor("no storage record")
    dtype = _torch_dtype(header.dtype)
    itemsize = DTYPE_ITEMSIZE[header.dtype]
    sizes = header.size
    numel = math.prod(sizes)
    base = item.offset + record.data_offset
    if numel == 0:
        yield item.chunk.offsets, torch.empty(sizes, dtype=dtype)
        return
    if not header.is_row_major or not sizes:
        # Small or unusual views: read the whole storage and view it as saved.
        raw = bytearray(f.pread(base, record.size))
        storage = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        yield item.chunk.offsets, storage.as_strided(sizes, header.stride, header.storage_offset)
        return
    row_elems = math.prod(sizes[1:])
    row_bytes = row_elems * itemsize
    rows_per_block = max(1, max_bytes // max(1, row_bytes))
    start = base + header.storage_offset * itemsize
    for r0 in range(0, sizes[0], rows_per_block):
        r1 = min(sizes[0], r0 + rows_per_block)
        raw = bytearray(f.pread(start + r0 * row_bytes, (r1 - r0) * row_bytes))
        if len(raw) != (r1 - r0) * row_bytes:
            raise UnreadableTensor("payload shorter than its shape")
        block = torch.frombuffer(raw, dtype=dtype).view((r1 - r0, *sizes[1:])) if raw else torch.empty(
            (r1 - r0, *sizes[1:]), dtype=dtype)
        offsets = (item.chunk.offsets[0] + r0, *item.chunk.offsets[1:])
        yield offsets, block


def read_chunk(f: ReadOnlyFile, item: Item, archive: Archive, header: TensorHeader) -> torch.Tensor:
    """The whole chunk as one tensor (memory: the chunk's size)."""
    import torch

    blocks = [t for _, t in iter_row_blocks(f, item, archive, header, max_bytes=1 << 62)]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)
