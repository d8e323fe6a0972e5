"""The :class:`~ckptverify.formats.describe.Description` of a DCP checkpoint, from what the pipeline read safely.

Each stored chunk is a :class:`~ckptverify.formats.describe.Payload` (storage byte range, in the file or the
decoded stream of a transformed item; view; global offsets; protecting checksum); per-rank metadata gives one
payload per copy. Every item is in ``stored``. Non-tensor items give plain values via the inert pickle reader (or
their bytes' digest). Opens no file: it reads through the readers the pipeline opened and change-checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from ckptverify.dcp.layout import Item, Layout
from ckptverify.errors import BadPickle
from ckptverify.formats.describe import Description, Payload, StoredRange, SubclassDesc, SubclassPart, TensorDesc
from ckptverify.safeparse.torchsave import SubclassHeader, TensorHeader, leaf_values, scan_pickle
from ckptverify.safeparse.zipwalk import Archive, Record

__all__ = ["ReadItem", "describe_dcp"]


class ReadItem(NamedTuple):
    """One item as the pipeline read it: ``item`` as placed (for safetensors blobs, at its own bytes), its ``archive``
    (of the decoded bytes if transformed), ``header`` if readable, ``base`` (archive start in ``reader``'s bytes),
    ``storage`` record and its ``checksum``."""

    item: Item
    archive: Archive
    header: TensorHeader | SubclassHeader | None
    base: int
    reader: Any
    storage: Record | None = None
    checksum: str = "none"


def describe_dcp(root: str, layout: Layout, read: Iterable[ReadItem], *, files: dict[str, Any],
                 values: bool = False, values_skip: frozenset[str] | set[str] = frozenset()) -> Description:
    """The description of the DCP checkpoint at ``root`` from ``layout``, the parsed items ``read`` and the opened
    ``files`` (``None``: could not be opened). ``values``: also plain values (not those in ``values_skip``)."""
    read = list(read)
    shared = {n: f for n, f in sorted(files.items()) if f is not None}
    desc = Description(root=root, format="dcp", files=dict.fromkeys(shared, "dcp"),
                       tensors={fqn: TensorDesc(fqn, t.dtype, t.shape) for fqn, t in layout.tensors.items()},
                       metadata_files=list(layout.metadata_files))
    readers: dict[tuple[str, int, int], Any] = {}
    for r in read:
        item = r.item
        if item.transforms:
            readers[(item.file, item.offset, item.length)] = r.reader
        if item.kind != "tensor":
            continue
        # The metadata makes a tensor item only for a chunk of a tensor it lists.
        chunk, t = item.chunk, desc.tensors[item.fqn]
        assert chunk is not None
        h, rec = r.header, r.storage
        if isinstance(h, SubclassHeader):
            _describe_subclass(t, r, h)
            continue
        if h is None or rec is None:
            t.unread.append(f"{item.fqn} chunk {list(chunk.offsets)}" + ("" if h is None else ": no storage record"))
            continue
        t.payloads.append(_payload(r, rec, h, chunk.offsets))
    desc.stored.extend(StoredRange(i.fqn, i.chunk.offsets if i.chunk else None, i.file, i.offset, i.length)
                       for i in layout.items if i.file in shared)
    if values:
        desc.values.update(_values(r for r in read if r.item.kind == "bytes" and r.item.fqn not in values_skip))

    def open_(what: Payload | str) -> Any:
        if isinstance(what, str):
            return shared[what]
        if what.stored is not None:  # an encoded payload: the decoded stream of its item
            start, end = what.stored
            return readers[(what.file, start, end - start)]
        return shared[what.file]

    desc.opener = open_
    return desc


def _describe_subclass(t: TensorDesc, r: ReadItem, h: SubclassHeader) -> None:
    """``t`` stored as a subclass in item ``r``: one payload per inner tensor (DCP saves a subclass whole)."""
    item, chunk = r.item, r.item.chunk
    assert chunk is not None
    where = f"{item.fqn} chunk {list(chunk.offsets)}"
    if any(chunk.offsets) or tuple(chunk.sizes) != tuple(t.shape) or t.subclass is not None:
        t.unread.append(f"{where}: a {h.short_name} stored as a chunk of a larger tensor")
        return
    desc = SubclassDesc(h.cls, h.context)
    for name, part in h.parts:
        rec = r.archive.record(f"data/{part.storage_key}")
        if rec is None:
            t.unread.append(f"{where}: no storage record for its {name!r} part")
            return
        desc.parts.append(SubclassPart(name, part.dtype, part.size, _payload(r, rec, part, (0,) * len(part.size))))
    t.subclass = desc


def _payload(r: ReadItem, rec: Record, view: TensorHeader, chunk_offsets: tuple[int, ...]) -> Payload:
    """The piece of item ``r`` in storage record ``rec``, viewed as ``view`` says, at ``chunk_offsets``."""
    item = r.item
    encoded = bool(item.transforms)
    return Payload(file=item.file, offset=r.base + rec.data_offset, length=rec.size, dtype=view.dtype,
                   shape=view.size, stride=view.stride, storage_offset=view.storage_offset,
                   chunk_offsets=chunk_offsets, encoding="+".join(item.transforms) if encoded else "raw",
                   checksum=r.checksum, stored=(item.offset, item.end) if encoded else None)


def _values(items: Iterable[ReadItem]) -> dict[str, str]:
    from ckptverify.fingerprint import digest_bytes

    got: dict[str, str] = {}
    done: set[str] = set()
    for r in items:
        item = r.item
        if item.fqn in done:
            continue
        rec = r.archive.record("data.pkl")
        if rec is None:
            continue
        done.add(item.fqn)
        data = r.reader.pread(r.base + rec.data_offset, rec.size)
        try:
            got.update(leaf_values(scan_pickle(data).root, prefix=item.fqn))
        except BadPickle:
            got[item.fqn] = f"pickle:xxh3-128:{digest_bytes(data)}"
    return got
