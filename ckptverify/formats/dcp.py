"""The description of a DCP checkpoint (:class:`~ckptverify.formats.describe.Description`), from what was
read safely: its metadata (:class:`~ckptverify.dcp.layout.Layout`) and each item's archive and tensor header
(:mod:`ckptverify.safeparse.torchsave`, through the DCP pipeline that checked them).

Every tensor is named by its FQN with its global dtype and shape; each stored chunk is one
:class:`~ckptverify.formats.describe.Payload`: the storage record's byte range (of the file as stored, or of
the decoded stream of an item written through stream transforms: ``encoding`` names them and ``stored``
gives the item's stored bytes), the view onto it, the chunk's offsets in the global tensor and the checksum
that protects those bytes (the zip record's CRC-32, the manifest's block digests, or none: DCP's
safetensors blobs). A chunk that per-rank metadata lists once per rank has one payload per copy. Every
item, tensor or not, is in ``stored`` (the byte ranges a manifest digests one by one). Non-tensor items
give plain values (``values``): each item's ``data.pkl`` read through the inert pickle reader
(:func:`~ckptverify.safeparse.pickle_scan.leaf_values`), or its bytes' digest when it cannot be read so.

Nothing here opens a file: the pipeline hands the readers it opened (checked against changes while it
ran), and the description reads through them (:meth:`~ckptverify.formats.describe.Description.open`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ckptverify.dcp.layout import Item, Layout
from ckptverify.formats.describe import Description, Payload, StoredRange, SubclassDesc, SubclassPart, TensorDesc
from ckptverify.safeparse.torchsave import SubclassHeader, TensorHeader
from ckptverify.safeparse.zipwalk import Archive, Record

__all__ = ["ReadItem", "describe_dcp"]


class ReadItem(NamedTuple):
    """One item as the DCP pipeline read it: ``item`` as the metadata places it in its file (for DCP's
    safetensors blobs, at the tensor's own bytes), its ``archive`` (the records of its ``torch.save`` zip,
    of the decoded bytes for a transformed item) and, for a tensor item whose header could be read, its
    ``header``. ``base``: where the archive starts in the bytes ``reader`` reads (the file's, or the
    decoded stream's). ``storage``: the tensor's storage record (``data/KEY`` of its header), and
    ``checksum`` what protects its bytes (:attr:`~ckptverify.formats.describe.Payload.checksum`)."""

    item: Item
    archive: Archive
    header: TensorHeader | SubclassHeader | None
    base: int
    reader: Any
    storage: Record | None = None
    checksum: str = "none"


def describe_dcp(root: str, layout: Layout, read: Iterable[ReadItem], *, files: dict[str, Any],
                 values: bool = False, values_skip: frozenset[str] | set[str] = frozenset(),
                 side: Description | None = None) -> Description:
    """The description of the DCP checkpoint at ``root``: ``layout`` from its metadata, ``read`` the items
    whose archive parsed (in the order the pipeline checked them), ``files`` the readers of its opened files
    by name (shards and side files; ``None`` for one that could not be opened). ``values``: also read every
    non-tensor item's plain values, except those of the items named in ``values_skip``. ``side``: the
    description of the framework side files beside the shards (``meta.pt``, ...), merged in (their tensors
    and values named ``FILE:PATH``)."""
    read = list(read)
    desc = Description(root=root, target=root, format="dcp", metadata_files=list(layout.metadata_files))
    for name, f in sorted(files.items()):
        if f is not None:
            desc.files[name] = "dcp"
    for fqn, t in layout.tensors.items():
        desc.tensors[fqn] = TensorDesc(fqn, t.dtype, t.shape)
    readers: dict[tuple[str, int, int], Any] = {}
    tensors = desc.tensors
    for r in read:
        item = r.item
        if item.transforms:
            readers[(item.file, item.offset, item.length)] = r.reader
        chunk = item.chunk
        if item.kind != "tensor" or chunk is None:
            continue
        t = tensors.get(item.fqn)
        if t is None:
            continue
        h, rec = r.header, r.storage
        if isinstance(h, SubclassHeader):
            _describe_subclass(t, r, h)
            continue
        if h is None or rec is None:
            t.unread.append(f"{item.fqn} chunk {list(chunk.offsets)}" + ("" if h is None else ": no storage record"))
            continue
        encoded = bool(item.transforms)
        t.payloads.append(Payload(
            file=item.file, offset=r.base + rec.data_offset, length=rec.size, dtype=h.dtype, shape=h.size,
            stride=h.stride, storage_offset=h.storage_offset, chunk_offsets=chunk.offsets,
            encoding="+".join(item.transforms) if encoded else "raw", checksum=r.checksum,
            stored=(item.offset, item.end) if encoded else None))
    desc.stored.extend(StoredRange(i.fqn, i.chunk.offsets if i.chunk else None, i.file, i.offset, i.length)
                       for i in layout.items if files.get(i.file) is not None)
    if values:
        desc.values.update(_values(r for r in read if r.item.kind == "bytes" and r.item.fqn not in values_skip))
    shared = {n: f for n, f in files.items() if f is not None}
    desc.opener = _opener(shared, readers)
    if side is not None:
        desc.files.update(side.files)
        desc.tensors.update(side.tensors)
        desc.values.update(side.values)
        desc.unread.update(side.unread)
    return desc


def _describe_subclass(t: TensorDesc, r: ReadItem, h: SubclassHeader) -> None:
    """``t`` stored as a tensor subclass in item ``r``: one payload per inner tensor (the whole tensor: a
    subclass's item is never a chunk of a larger tensor, DCP saves it whole)."""
    item, chunk = r.item, r.item.chunk
    assert chunk is not None
    where = f"{item.fqn} chunk {list(chunk.offsets)}"
    if any(chunk.offsets) or tuple(chunk.sizes) != tuple(t.shape) or t.subclass is not None:
        t.unread.append(f"{where}: a {h.short_name} stored as a chunk of a larger tensor")
        return
    encoded = bool(item.transforms)
    desc = SubclassDesc(h.cls, h.context)
    for name, part in h.parts:
        rec = r.archive.record(f"data/{part.storage_key}")
        if rec is None:
            t.unread.append(f"{where}: no storage record for its {name!r} part")
            return
        desc.parts.append(SubclassPart(name, part.dtype, part.size, Payload(
            file=item.file, offset=r.base + rec.data_offset, length=rec.size, dtype=part.dtype, shape=part.size,
            stride=part.stride, storage_offset=part.storage_offset, chunk_offsets=(0,) * len(part.size),
            encoding="+".join(item.transforms) if encoded else "raw", checksum=r.checksum,
            stored=(item.offset, item.end) if encoded else None)))
    t.subclass = desc


def _opener(files: dict[str, Any], readers: dict[tuple[str, int, int], Any]) -> Callable[[Payload | str], Any]:
    def open_(what: Payload | str) -> Any:
        if isinstance(what, str):
            return files[what]
        if what.stored is not None:
            start, end = what.stored
            return readers[(what.file, start, end - start)]
        return files[what.file]

    return open_


def _values(items: Iterable[ReadItem]) -> dict[str, str]:
    from ckptverify.fingerprint import digest_bytes
    from ckptverify.safeparse.pickle_scan import BadPickle, leaf_values, scan_pickle

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
