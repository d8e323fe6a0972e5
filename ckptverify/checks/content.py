"""Content checks without a manifest: each item's zip structure and every record's CRC-32.

DCP writes each item as a ``torch.save`` zip whose records carry CRC-32s that neither ``torch.load`` nor
``dcp.load`` ever check. Here every record's bytes are hashed and compared, and the structure around
them is cross-checked (:mod:`ckptverify.dcp.torchsave`), so a flipped bit anywhere in an item is found.
Tensor payload corruption is localized to the FQN, chunk, byte range and element range.
"""

from __future__ import annotations

import math
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptverify.checks import item_label, item_location
from ckptverify.dcp.layout import DTYPE_ITEMSIZE, Item
from ckptverify.dcp.torchsave import Archive, ArchiveError, Record, TensorHeader, parse_archive, tensor_header
from ckptverify.findings import Finding, Location, error, warning
from ckptverify.readers import ReadOnlyFile

Progress = Callable[[int], None]


@dataclass(slots=True)
class FileResult:
    """What checking one file found and covered."""

    file: str
    findings: list[Finding] = field(default_factory=list)
    items: int = 0
    records: int = 0
    bytes_hashed: int = 0
    uncheckable: int = 0


def is_safetensors_blob(head: bytes, file_size: int) -> bool:
    """True if ``head`` (>= 9 bytes) starts a safetensors blob: u64 header length, then ``{``."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack_from("<Q", head)
    return 2 <= n <= file_size - 8 and head[8:9] == b"{"


def safetensors_files(root_files: dict[str, ReadOnlyFile | None], items: list[Item]) -> set[str]:
    """Files written in DCP's safetensors format (their tensor items do not address their own bytes)."""
    found: set[str] = set()
    for item in items:
        f = root_files.get(item.file)
        if f is None or item.kind != "tensor" or item.file in found:
            continue
        head = f.pread(item.offset, 9)
        if head[:4] != b"PK\x03\x04" and is_safetensors_blob(head, f.size):
            found.add(item.file)
    return found


def check_file(f: ReadOnlyFile, name: str, items: list[Item], *, safetensors: bool,
               progress: Progress | None = None) -> FileResult:
    """Check every item of one file that lies within it. ``items`` must all belong to ``name``."""
    result = FileResult(file=name)
    for item in sorted(items, key=lambda it: it.offset):
        if item.end > f.size:
            continue  # reported by the structural check; reading it would only add noise
        if item.transforms:
            result.uncheckable += 1
            result.findings.append(warning(
                "content-uncheckable",
                f"{item_label(item)} was written through stream transforms {list(item.transforms)}; its content "
                "cannot be checked without a manifest",
                location=item_location(item),
            ))
            _advance(progress, item.length)
            continue
        if safetensors and item.kind == "tensor":
            result.uncheckable += 1
            _advance(progress, item.length)
            continue
        result.items += 1
        _check_item(f, item, result, progress)
    if safetensors:
        result.findings.append(warning(
            "content-uncheckable",
            f"{name} holds tensors in the safetensors serialization format, which carries no checksums: "
            f"{result.uncheckable} tensor item(s) cannot be checked without a manifest",
            location=Location(file=name),
        ))
    return result


def _check_item(f: ReadOnlyFile, item: Item, result: FileResult, progress: Progress | None) -> None:
    base = item.offset

    def read(offset: int, n: int) -> bytes:
        n = max(0, min(n, item.length - offset))
        return f.pread(base + offset, n) if offset >= 0 else b""

    try:
        archive = parse_archive(read, item.length)
    except ArchiveError as exc:
        start = base + (exc.start or 0)
        end = base + (exc.end if exc.end else item.length)
        result.findings.append(error(
            "zip-structure",
            f"{item_label(item)} is not an intact torch.save archive: {exc}",
            location=item_location(item, byte_range=(start, max(end, start + 1))),
        ))
        _advance(progress, item.length)
        return

    crcs: dict[str, int] = {}
    for rec in archive.records:
        crcs[rec.name] = f.crc32(base + rec.data_offset, base + rec.data_end, progress)
        result.records += 1
        result.bytes_hashed += rec.size
    _advance(progress, item.length - sum(r.size for r in archive.records))

    stored = [r.crc for r in archive.records]
    if all(c == 0 for c in stored) and any(crcs[r.name] != 0 for r in archive.records):
        result.uncheckable += 1
        result.findings.append(warning(
            "content-uncheckable",
            f"{item_label(item)} was saved with CRC-32 disabled (torch.serialization.set_crc32_options(False)); "
            "its structure is intact but its content cannot be checked without a manifest",
            location=item_location(item, byte_range=(item.offset, item.end)),
        ))
        return

    header: TensorHeader | None = None
    pkl = archive.record("data.pkl")
    if pkl is None:
        result.findings.append(error(
            "zip-structure", f"{item_label(item)} has no data.pkl record",
            location=item_location(item, byte_range=(item.offset, item.end)),
        ))
    elif item.kind == "tensor" and crcs[pkl.name] == pkl.crc:
        try:
            header = tensor_header(read(pkl.data_offset, pkl.size))
        except pickle.UnpicklingError as exc:
            result.findings.append(error(
                "tensor-record",
                f"{item_label(item)} should hold a plain tensor but its data.pkl does not describe one: {exc}",
                location=item_location(item, record=pkl.name,
                              byte_range=(base + pkl.data_offset, base + pkl.data_end)),
            ))

    for rec in archive.records:
        if crcs[rec.name] != rec.crc:
            result.findings.append(_crc_finding(item, archive, rec, header, crcs[rec.name]))

    if header is not None:
        result.findings.extend(_tensor_consistency(item, archive, header))


def _crc_finding(item: Item, archive: Archive, rec: Record, header: TensorHeader | None, actual: int) -> Finding:
    base = item.offset
    byte_range = (base + rec.data_offset, base + rec.data_end)
    expected_hex, actual_hex = f"{rec.crc:08x}", f"{actual:08x}"
    storage = header.storage_key if header is not None else "0"
    is_payload = item.kind == "tensor" and rec.name == f"{archive.prefix}/data/{storage}"
    if not is_payload:
        role = "tensor header (data.pkl)" if rec.name.endswith("/data.pkl") else f"record {rec.name!r}"
        return error(
            "zip-crc",
            f"{item_label(item)}: {role} is corrupt (CRC-32 {actual_hex}, recorded {expected_hex})",
            location=item_location(item, record=rec.name, byte_range=byte_range),
            expected=expected_hex, actual=actual_hex,
        )
    assert item.chunk is not None and item.dtype is not None
    itemsize = DTYPE_ITEMSIZE[item.dtype]
    offset = header.storage_offset if header is not None else 0
    row_major = header.is_row_major if header is not None else True
    numel = item.chunk.numel
    if row_major and numel:
        first = max(0, min(numel - 1, 0 - offset))
        last = max(0, min(numel - 1, math.ceil(rec.size / itemsize) - 1 - offset))
        elements = (first, last + 1)
    else:
        elements = (0, numel)
    loc = item_location(item, record=rec.name, byte_range=byte_range, element_range=elements,
               global_index_first=_global_index(item, elements[0]) if numel else None,
               global_index_last=_global_index(item, elements[1] - 1) if numel else None)
    return error(
        "zip-crc",
        f"{item_label(item)}: tensor payload is corrupt (CRC-32 {actual_hex}, recorded {expected_hex}); "
        f"affected elements [{elements[0]}, {elements[1]}) of the chunk",
        location=loc, expected=expected_hex, actual=actual_hex,
    )


def _tensor_consistency(item: Item, archive: Archive, header: TensorHeader) -> list[Finding]:
    assert item.chunk is not None and item.dtype is not None
    out: list[Finding] = []
    loc = item_location(item, record=f"{archive.prefix}/data.pkl")
    if header.dtype != item.dtype:
        out.append(error("tensor-record", f"{item_label(item)} holds {header.dtype} values but the metadata says "
                         f"{item.dtype}", location=loc, expected=item.dtype, actual=header.dtype))
    if header.size != item.chunk.sizes:
        out.append(error("tensor-record", f"{item_label(item)} holds a tensor of shape {list(header.size)} but the "
                         f"metadata says {list(item.chunk.sizes)}", location=loc,
                         expected=list(item.chunk.sizes), actual=list(header.size)))
    storage = archive.record(f"data/{header.storage_key}")
    if storage is None:
        out.append(error("tensor-record", f"{item_label(item)} has no storage record data/{header.storage_key}",
                         location=loc))
        return out
    itemsize = DTYPE_ITEMSIZE.get(header.dtype)
    if itemsize is not None and storage.size != header.storage_numel * itemsize:
        out.append(error("tensor-record", f"{item_label(item)}: storage record is {storage.size} bytes but holds "
                         f"{header.storage_numel} {header.dtype} elements", location=loc,
                         expected=header.storage_numel * itemsize, actual=storage.size))
    extent = header.storage_offset + sum((n - 1) * s for n, s in zip(header.size, header.stride, strict=True)) + 1
    if math.prod(header.size) and extent > header.storage_numel:
        out.append(error("tensor-record", f"{item_label(item)}: the tensor view reaches past its storage",
                         location=loc))
    return out


def _global_index(item: Item, linear: int) -> tuple[int, ...]:
    assert item.chunk is not None
    coords = []
    for size in reversed(item.chunk.sizes):
        coords.append(linear % size if size else 0)
        linear = linear // size if size else 0
    return tuple(o + c for o, c in zip(item.chunk.offsets, reversed(coords), strict=True))


def _advance(progress: Progress | None, n: int) -> None:
    if progress is not None and n > 0:
        progress(n)
