"""Content checks without a manifest: each item's zip structure and every record's CRC-32.

Neither ``torch.load`` nor ``dcp.load`` checks the CRC-32s DCP writes; here every record is hashed and the
structure cross-checked (:mod:`ckptverify.safeparse.zipwalk`), and payload damage is localized to FQN, chunk,
byte and element range. Small items are read many at a time and checked from memory while planning; large ones
are hashed later in segments on all cores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ckptverify.checks import item_label, item_location
from ckptverify.checks.crcflip import false_match_probability, locate_single_bit
from ckptverify.dcp.layout import DTYPE_ITEMSIZE, Item
from ckptverify.errors import ArchiveError
from ckptverify.findings import Finding, Location, error, info, warning
from ckptverify.safeparse.readers import ReadOnlyFile, crc32
from ckptverify.safeparse.torchsave import SubclassHeader, TensorHeader, item_header
from ckptverify.safeparse.zipwalk import Archive, Record, TemplateCache, parse_archive, parse_item, range_reader

#: Items up to this size are read whole, with their neighbours, and checked from memory while planning.
SMALL_ITEM_BYTES = 1 << 20
#: Most bytes read at once for consecutive small items, and the largest gap between two read over.
WINDOW_BYTES = 8 << 20
WINDOW_GAP = 64 << 10


@dataclass(slots=True)
class FileResult:
    """What checking one file found and covered."""

    findings: list[Finding] = field(default_factory=list)
    items: int = 0
    records: int = 0
    bytes_hashed: int = 0


#: Bytes read at once for the first bytes of consecutive items.
HEAD_WINDOW_BYTES = 1 << 20


def safetensors_files(root_files: dict[str, ReadOnlyFile | None], items: list[Item]) -> set[str]:
    """Files written in DCP's safetensors format (their tensor items do not address their own bytes): a tensor item
    starts with a u64 header length, then ``{``, not a zip."""
    found: set[str] = set()
    buffers: dict[str, tuple[int, bytes]] = {}  # the first bytes of many items, read at once
    for item in sorted(items, key=lambda it: (it.file, it.offset)):
        f = root_files.get(item.file)
        if f is None or item.kind != "tensor" or item.file in found:
            continue
        start, buf = buffers.get(item.file, (0, b""))
        if not start <= item.offset <= start + len(buf) - 9:
            start, buf = item.offset, f.pread(item.offset, HEAD_WINDOW_BYTES)
            buffers[item.file] = (start, buf)
        head = buf[item.offset - start:item.offset - start + 9]
        if len(head) == 9 and head[:4] != b"PK\x03\x04" and head[8:9] == b"{" \
                and 2 <= struct.unpack_from("<Q", head)[0] <= f.size - 8:
            found.add(item.file)
    return found


@dataclass(slots=True)
class ItemPlan:
    """An item whose archive structure parsed: the records whose CRCs must be computed."""

    item: Item
    archive: Archive
    #: The header from ``data.pkl`` once its CRC checked out (tensor items; a ``SubclassHeader`` for a subclass).
    header: TensorHeader | SubclassHeader | None = None
    #: Reader of the item's bytes when not its stored file (decoded stream transforms, a safetensors blob);
    #: ``None``: ``item.file``.
    reader: Any = None
    #: The CRC-32 of every record, in archive order, when planning computed them (small items).
    crcs: list[int] | None = None
    #: The bytes of ``data.pkl``, when planning read them.
    pkl: bytes | None = None


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range ``[start, end)`` of ``file``, a part of record ``record`` of plan ``plan`` (by index)."""

    file: str
    start: int
    end: int
    plan: int
    record: int


def plan_file(f: ReadOnlyFile, name: str, items: list[Item], *, safetensors: bool,
              templates: TemplateCache) -> tuple[list[ItemPlan], FileResult]:
    """Parse the archive structure of every item of one file (none stream-transformed: see
    :mod:`~ckptverify.checks.transformed`). Returns the structurally intact items and a result of structural findings.
    Small items (:data:`SMALL_ITEM_BYTES`) are read whole and CRC-checked here (``ItemPlan.crcs``); larger ones only
    have headers read, their payloads left to the caller."""
    result = FileResult()
    outcomes: dict[int, ItemPlan | Finding] = {}  # by position in offset order, so findings keep that order
    small: list[tuple[int, Item]] = []
    uncheckable = 0
    for n, item in enumerate(sorted(items, key=lambda it: it.offset)):
        if item.end > f.size:
            continue  # reported by the structural check; reading it would only add noise
        if safetensors and item.kind == "tensor":
            uncheckable += 1
            continue
        result.items += 1
        if item.length <= SMALL_ITEM_BYTES:
            small.append((n, item))
            continue
        try:
            outcomes[n] = ItemPlan(item, parse_archive(range_reader(f, item.offset, item.length), item.length))
        except ArchiveError as exc:
            outcomes[n] = structure_finding(item_label(item), exc, item_location(item), item.offset, item.length)
    for start, end, batch in read_windows(((item.offset, item.end, (n, item)) for n, item in small), overlap=True):
        buf = f.pread(start, end - start)
        for n, item in batch:
            outcomes[n] = _plan_in_memory(buf, item.offset - start, item, templates)
    in_order = [outcomes[n] for n in sorted(outcomes)]
    plans = [o for o in in_order if isinstance(o, ItemPlan)]
    result.findings.extend(o for o in in_order if not isinstance(o, ItemPlan))
    if safetensors:
        result.findings.append(warning(
            "content-uncheckable",
            f"{name} holds tensors in the safetensors serialization format, which carries no checksums: "
            f"{uncheckable} tensor item(s) cannot be checked without a manifest",
            location=Location(file=name),
        ))
    return plans, result


def read_windows(spans: Iterable[tuple[int, int, Any]], *, overlap: bool) -> list[tuple[int, int, list[Any]]]:
    """Group ``(offset, end, what)`` spans of one file, sorted by offset, into byte ranges read at once: at most
    :data:`WINDOW_BYTES`, over gaps of up to :data:`WINDOW_GAP`. A span starting before its range's end joins it only
    if ``overlap`` (else it starts the next range). Returns ``(start, end, whats)`` per range."""
    out: list[tuple[int, int, list[Any]]] = []
    for offset, end, what in spans:
        if out:
            start, stop, batch = out[-1]
            if end - start <= WINDOW_BYTES and offset <= stop + WINDOW_GAP and (overlap or stop <= offset):
                batch.append(what)
                out[-1] = (start, max(stop, end), batch)
                continue
        out.append((offset, end, [what]))
    return out


def _plan_in_memory(buf: bytes, base: int, item: Item, templates: TemplateCache) -> ItemPlan | Finding:
    """Parse the item at ``buf[base:base + item.length]`` (against a template where one fits) and CRC each record."""
    length = item.length
    template = templates.get(length)
    matched = template.match(buf, base) if template is not None else None
    if matched is not None:
        archive, known = matched
    else:
        try:
            parsed = parse_item(buf, base, length)
        except ArchiveError as exc:
            return structure_finding(item_label(item), exc, item_location(item), item.offset, item.length)
        archive, known = parsed.archive, [None] * len(parsed.archive.records)
    view = memoryview(buf)
    crcs = [c if c is not None else crc32(view[base + r.data_offset:base + r.data_end])
            for c, r in zip(known, archive.records, strict=True)]
    if matched is None:
        templates.parsed(buf, base, length, parsed, crcs)
    pkl = archive.record("data.pkl")
    data_pkl = buf[base + pkl.data_offset:base + pkl.data_end] if pkl is not None and item.kind == "tensor" else None
    return ItemPlan(item, archive, crcs=crcs, pkl=data_pkl)


def structure_finding(label: str, exc: ArchiveError, where: Location, base: int, length: int) -> Finding:
    """The ``zip-structure`` error of archive ``label`` (bytes ``[base, base + length)`` of ``where``'s file), which did
    not parse: at the bytes ``exc`` names, else from their start to the archive's end."""
    start = base + (exc.start or 0)
    end = base + (exc.end if exc.end else length)
    return error("zip-structure", f"{label} is not an intact torch.save archive: {exc}",
                 location=dataclasses.replace(where, byte_range=(start, max(end, start + 1))))


def segments(plans: Iterable[tuple[int, ItemPlan]], max_bytes: int) -> list[Segment]:
    """Split every record payload of ``plans`` (``(index, plan)``) into segments of at most ``max_bytes``, hashed in
    parallel and their CRCs combined, so one huge record does not serialise the work."""
    out: list[Segment] = []
    for p, plan in plans:
        base = plan.item.offset
        for r, rec in enumerate(plan.archive.records):
            start, end = base + rec.data_offset, base + rec.data_end
            starts = range(start, end, max_bytes) or [start]  # an empty record is one empty segment
            out.extend(Segment(plan.item.file, s, min(end, s + max_bytes), p, r) for s in starts)
    return out


def judge_item(f: ReadOnlyFile, plan: ItemPlan, crcs: list[int], result: FileResult) -> None:
    """Compare the computed CRCs (one per record, in archive order) with the recorded ones."""
    item, archive = plan.item, plan.archive
    records = archive.records
    result.records += len(records)
    result.bytes_hashed += sum(r.size for r in records)
    bad = bad_records(records, crcs)
    if bad is None:
        result.findings.append(crc_disabled(item_label(item), item_location(item, byte_range=(item.offset, item.end))))
        return
    computed = dict(zip((r.name for r in records), crcs, strict=True)) if bad else {}

    header: TensorHeader | SubclassHeader | None = None
    pkl = archive.record("data.pkl")
    if pkl is None:
        result.findings.append(error(
            "zip-structure", f"{item_label(item)} has no data.pkl record",
            location=item_location(item, byte_range=(item.offset, item.end)),
        ))
    elif item.kind == "tensor" and (not bad or computed[pkl.name] == pkl.crc):
        try:
            data_pkl = plan.pkl if plan.pkl is not None else \
                range_reader(f, item.offset, item.length)(pkl.data_offset, pkl.size)
            plan.pkl = None  # read once; 100 000 plans need not keep theirs
            header = item_header(data_pkl)
        except pickle.UnpicklingError as exc:
            result.findings.append(error(
                "tensor-record",
                f"{item_label(item)} should hold a plain tensor but its data.pkl does not describe one: {exc}",
                location=item_location(item, record=pkl.name,
                                       byte_range=(item.offset + pkl.data_offset, item.offset + pkl.data_end)),
            ))

    plan.header = header
    for rec in bad:
        result.findings.extend(_crc_findings(item, archive, rec, header, computed[rec.name]))

    if header is not None:
        result.findings.extend(_consistency(item, archive, header))


def bad_records(records: list[Record], crcs: list[int]) -> list[Record] | None:
    """The records whose bytes do not match their CRC-32 (``crcs``: computed, in record order); ``None`` when the
    archive was saved with CRC-32 disabled (every recorded CRC-32 is 0, some computed one is not)."""
    bad = [r for r, c in zip(records, crcs, strict=True) if c != r.crc]
    if bad and all(r.crc == 0 for r in records) and any(crcs):
        return None
    return bad


def crc_disabled(label: str, where: Location) -> Finding:
    """The ``content-uncheckable`` warning for an archive :func:`bad_records` found saved with CRC-32 disabled."""
    return warning(
        "content-uncheckable",
        f"{label} was saved with CRC-32 disabled (torch.serialization.set_crc32_options(False)); "
        "its structure is intact but its content cannot be checked without a manifest",
        location=where,
    )


def crc_findings(label: str, role: str, rec: Record, actual: int, where: Location, *, detail: str = "",
                 hint_at: Any = None) -> list[Finding]:
    """The ``zip-crc`` error for record ``rec`` (holding ``role``) of ``label``, at ``where`` (its byte range in the
    file), plus a ``zip-crc-bit`` hint when one flipped bit explains it: at that byte, or where ``hint_at(byte in
    record)`` says (``None``: no hint)."""
    expected_hex, actual_hex = f"{rec.crc:08x}", f"{actual:08x}"
    out = [error("zip-crc", f"{label}: {role} is corrupt (CRC-32 {actual_hex}, recorded {expected_hex}){detail}",
                 location=where, expected=expected_hex, actual=actual_hex)]
    bit = locate_single_bit(rec.crc, actual, rec.size)
    if bit is not None and where.byte_range is not None:
        at = where.byte_range[0] + bit[0]
        loc = hint_at(bit[0]) if hint_at is not None else dataclasses.replace(where, byte_range=(at, at + 1))
        if loc is not None:
            out.append(_bit_hint(label, rec, bit, loc))
    return out


def _crc_findings(item: Item, archive: Archive, rec: Record, header: TensorHeader | SubclassHeader | None,
                  actual: int) -> list[Finding]:
    """:func:`crc_findings` for a record of a DCP item: of a tensor payload, the elements it holds; of a tensor
    subclass, the inner tensor it holds."""
    base = item.offset
    byte_range = (base + rec.data_offset, base + rec.data_end)
    storage = header.storage_key if isinstance(header, TensorHeader) else "0"
    if isinstance(header, SubclassHeader) or item.kind != "tensor" or rec.name != f"{archive.prefix}/data/{storage}":
        part = next((name for name, h in header.parts if rec.name == f"{archive.prefix}/data/{h.storage_key}"),
                    None) if isinstance(header, SubclassHeader) else None
        if part is not None:
            role = f"the {part!r} part of its {header.short_name}"  # type: ignore[union-attr]
        else:
            role = "tensor header (data.pkl)" if rec.name.endswith("/data.pkl") else f"record {rec.name!r}"
        return crc_findings(item_label(item), role, rec, actual,
                            item_location(item, record=rec.name, byte_range=byte_range))
    assert item.chunk is not None and item.dtype is not None
    itemsize = DTYPE_ITEMSIZE[item.dtype]
    offset = header.storage_offset if header is not None else 0
    row_major = header.is_row_major if header is not None else True
    numel = item.chunk.numel
    elements = touched_elements(0, rec.size, itemsize, offset, numel) if row_major else (0, numel)
    loc = item_location(item, record=rec.name, byte_range=byte_range, element_range=elements,
                        global_index_first=global_index(item, elements[0]) if numel else None,
                        global_index_last=global_index(item, elements[1] - 1) if numel else None)

    def hint_at(byte: int) -> Location | None:
        if not (row_major and numel):
            return None
        first, last = touched_elements(byte, byte + 1, itemsize, offset, numel)
        at = byte_range[0] + byte
        return item_location(item, record=rec.name, byte_range=(at, at + 1), element_range=(first, last),
                             global_index_first=global_index(item, first), global_index_last=global_index(item, first))

    return crc_findings(item_label(item), "tensor payload", rec, actual, loc, hint_at=hint_at,
                        detail=f"; affected elements [{elements[0]}, {elements[1]}) of the chunk")


def touched_elements(byte_start: int, byte_end: int, itemsize: int, storage_offset: int,
                     numel: int) -> tuple[int, int]:
    """Chunk elements (row-major, half-open) touched by storage bytes ``[byte_start, byte_end)``."""
    first = max(0, min(numel - 1, byte_start // itemsize - storage_offset))
    last = max(0, min(numel - 1, math.ceil(byte_end / itemsize) - 1 - storage_offset))
    return first, last + 1


def _bit_hint(label: str, rec: Record, bit: tuple[int, int], loc: Location) -> Finding:
    chance = false_match_probability(rec.size)
    where = f"element {loc.element_range[0]} " if loc.element_range else ""
    return info(
        "zip-crc-bit",
        f"{label}: the CRC mismatch is exactly what one flipped bit would give: bit {bit[1]} of byte "
        f"{bit[0]} of record {rec.name!r} ({where}at file byte {loc.byte_range[0]}). If more than one bit "
        f"changed, this position matches by chance (probability {chance:.2%}) and the whole range above "
        "is suspect.",
        location=loc,
        actual={"record_byte": bit[0], "bit": bit[1], "false_match_probability": chance},
    )


def _consistency(item: Item, archive: Archive, header: TensorHeader | SubclassHeader) -> list[Finding]:
    """A tensor record against the metadata (dtype, shape; a subclass's outer ones) and its storage record, or each of
    a subclass's inner tensors against its own (:func:`storage_findings`)."""
    record = f"{archive.prefix}/data.pkl"
    if isinstance(header, TensorHeader):
        out = _metadata_mismatch(item, header, record, f"{header.dtype} values", "a tensor")
        return out + storage_findings(archive, header.storage_key, [header],
                                      lambda: (item_label(item), item_location(item, record=record)))
    out = _metadata_mismatch(item, header, record, f"a {header.short_name} of {header.dtype}", f"a {header.short_name}")
    for name, part in header.parts:
        out.extend(storage_findings(archive, part.storage_key, [part], lambda name=name: (
            f"{item_label(item)}: the {name!r} part of its {header.short_name}", item_location(item, record=record))))
    return out


def _metadata_mismatch(item: Item, header: TensorHeader | SubclassHeader, record: str, with_dtype: str,
                       what: str) -> list[Finding]:
    """``tensor-record`` errors, at ``record``, where its dtype or shape is not the metadata's; ``with_dtype``,
    ``what``: what the messages say the record holds."""
    assert item.chunk is not None and item.dtype is not None
    if header.dtype == item.dtype and header.size == item.chunk.sizes:
        return []  # most items: no location built
    out: list[Finding] = []
    loc = item_location(item, record=record)
    if header.dtype != item.dtype:
        out.append(error("tensor-record", f"{item_label(item)} holds {with_dtype} but the metadata says {item.dtype}",
                         location=loc, expected=item.dtype, actual=header.dtype))
    if header.size != item.chunk.sizes:
        out.append(error("tensor-record", f"{item_label(item)} holds {what} of shape {list(header.size)} but the "
                         f"metadata says {list(item.chunk.sizes)}", location=loc,
                         expected=list(item.chunk.sizes), actual=list(header.size)))
    return out


def storage_findings(archive: Archive, key: str, views: list[TensorHeader],
                     at: Callable[[], tuple[str, Location]]) -> list[Finding]:
    """The ``tensor-record`` errors of storage ``key`` of ``archive`` and the tensors ``views`` onto it: its record is
    missing, holds other than the elements the pickle records, or a view reaches past it. ``at``: what names the
    tensors in a message, and where; asked only for an error, so every caller builds both inside it."""
    rec = archive.record(f"data/{key}")
    if rec is None:
        who, where = at()
        return [error("tensor-record", f"{who} has no storage record data/{key}", location=where)]
    out: list[Finding] = []
    # torch.save gives all the views of a storage one dtype, so one storage size.
    itemsize = DTYPE_ITEMSIZE.get(views[0].dtype or "") if views else None
    if itemsize is not None and rec.size != views[0].storage_numel * itemsize:
        who, where = at()
        out.append(error("tensor-record", f"{who}: storage record is {rec.size} bytes but holds "
                         f"{views[0].storage_numel} {views[0].dtype} elements", location=where,
                         expected=views[0].storage_numel * itemsize, actual=rec.size))
    past = [h for h in views if h.dtype is not None and not _view_fits(h)]
    if past:
        widest = max(past, key=TensorHeader.extent)
        who, where = at()
        out.append(error("tensor-record", f"{who}: the tensor view reaches past its storage of {widest.storage_numel} "
                         f"elements: views reach {widest.extent()} {widest.dtype} elements ({widest.extent_bytes()} "
                         "bytes)", location=where, expected=widest.extent_bytes(), actual=rec.size))
    return out


@functools.lru_cache(maxsize=1024)
def _view_fits(header: TensorHeader) -> bool:
    """The tensor view lies inside its storage (headers repeat: one per dtype and shape)."""
    return header.extent() <= header.storage_numel


def global_index(item: Item, linear: int) -> tuple[int, ...]:
    assert item.chunk is not None
    coords = []
    for size in reversed(item.chunk.sizes):
        coords.append(linear % size if size else 0)
        linear = linear // size if size else 0
    return tuple(o + c for o, c in zip(item.chunk.offsets, reversed(coords), strict=True))

