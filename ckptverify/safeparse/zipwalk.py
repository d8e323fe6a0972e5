"""Walking ``torch.save`` zip archives (each DCP item) without unpickling or decompressing anything.

:func:`parse_archive` walks torch's layout (stored, 64-byte aligned records with data descriptors, central
directory, zip64 end records) and cross-checks every field stored twice, so a flipped bit outside the payloads
is caught structurally; payloads are covered by CRC-32, computed by the caller.
:class:`ArchiveTemplate` proves an item of the same length structurally equal to a parsed one by comparing bytes
outside the varying payloads and CRC fields: 100 000 small items take a fraction of a second.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import ArchiveError

Reader = Callable[[int, int], bytes]
"""``read(offset, n)``: up to ``n`` bytes at ``offset`` relative to the item's first byte."""

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_EOCD = b"PK\x05\x06"
_EOCD64 = b"PK\x06\x06"
_LOCATOR64 = b"PK\x06\x07"
_ZIP64_EXTRA = 0x0001
_PAD_EXTRA = 0x4246  # "FB": torch's alignment padding
_PAD_BYTE = 0x5A  # "Z"
_FLAG_DESCRIPTOR = 0x0008
_FLAG_UTF8 = 0x0800
#: The only record flags and compression torch writes: data descriptor + UTF-8 names, stored.
TORCH_FLAGS = {_FLAG_DESCRIPTOR | _FLAG_UTF8, _FLAG_UTF8, _FLAG_DESCRIPTOR, 0}
MAX_RECORDS = 1 << 20


@dataclass(frozen=True, slots=True)
class Record:
    """One archive member. Offsets are relative to the item's first byte."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size


@dataclass(frozen=True, slots=True)
class Archive:
    records: tuple[Record, ...]
    prefix: str
    #: Position of each record by name (shared by the archives matched against one template).
    index: dict[str, int] | None = field(default=None, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.index is None:
            object.__setattr__(self, "index", {r.name: n for n, r in enumerate(self.records)})

    def record(self, suffix: str) -> Record | None:
        n = self.index.get(f"{self.prefix}/{suffix}")  # type: ignore[union-attr]
        return None if n is None else self.records[n]


def range_reader(f: Any, base: int = 0, length: int | None = None) -> Reader:
    """The :data:`Reader` of bytes ``[base, base + length)`` of the opened file ``f`` (to its end by default)."""
    length = f.size - base if length is None else length

    def read(offset: int, n: int) -> bytes:
        return f.pread(base + offset, max(0, min(n, length - offset))) if offset >= 0 else b""

    return read


def looks_like_zip(head: bytes) -> bool:
    return head[:4] == _LOCAL


def _unpack(fmt: str, data: bytes, at: int, what: str, base: int) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    if len(data) < at + size:
        raise ArchiveError(f"{what} is cut short", base + at, base + len(data))
    return struct.unpack_from(fmt, data, at)


def parse_archive(read: Reader, length: int, *, crc_fields: dict[str, list[int]] | None = None) -> Archive:
    """Parse and cross-check the archive in ``[0, length)``; raise :class:`ArchiveError`. With ``crc_fields``, also
    note per record the offsets of its 4-byte CRC fields (the only fields used solely to compare with each other)."""
    if length < 22:
        raise ArchiveError(f"{length} bytes is too short for a zip archive", 0, length)
    tail_len = min(length, 22 + 20 + 56)
    tail_at = length - tail_len
    tail = read(tail_at, tail_len)
    # torch writes no archive comment, so the end record is the last 22 bytes.
    eocd_at = length - 22
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment_len = _unpack(
        "<4sHHHHIIH", tail, eocd_at - tail_at, "end of central directory", tail_at
    )
    if sig != _EOCD or comment_len != 0:
        raise ArchiveError("end of central directory record not found at the end of the item",
                           eocd_at, length)
    if disk not in (0, 0xFFFF) or cd_disk not in (0, 0xFFFF) or n_disk != n_total:
        raise ArchiveError("end of central directory has inconsistent disk fields", eocd_at, length)
    cd_end = eocd_at
    locator_at = eocd_at - 20
    if locator_at >= 0 and tail[locator_at - tail_at : locator_at - tail_at + 4] == _LOCATOR64:
        _, l_disk, z64_at, l_disks = _unpack("<4sIQI", tail, locator_at - tail_at, "zip64 locator", tail_at)
        if l_disk != 0 or l_disks != 1 or z64_at != locator_at - 56:
            raise ArchiveError("zip64 end locator fields are inconsistent", locator_at, eocd_at)
        z = _unpack("<4sQHHIIQQQQ", read(z64_at, 56), 0, "zip64 end record", z64_at)
        zsig, zsize, made_by, needed, zdisk, zcd_disk, zn_disk, zn_total, zcd_size, zcd_offset = z
        if zsig != _EOCD64 or zsize != 44 or zdisk != 0 or zcd_disk != 0 or zn_disk != zn_total:
            raise ArchiveError("zip64 end record is malformed", z64_at, locator_at)
        if (made_by, needed) != (798, 45):
            raise ArchiveError(f"zip64 end record version fields ({made_by}, {needed}) differ from what "
                               "torch writes (798, 45)", z64_at, locator_at)
        for small, big, what in ((n_total, zn_total, "entry count"), (cd_size, zcd_size, "directory size"),
                                 (cd_offset, zcd_offset, "directory offset")):
            sentinel = 0xFFFF if what == "entry count" else 0xFFFFFFFF
            if small != big and small != sentinel:
                raise ArchiveError(f"end records disagree on the {what} ({small} vs {big})", z64_at, length)
        n_total, cd_size, cd_offset = zn_total, zcd_size, zcd_offset
        cd_end = z64_at
    if cd_offset + cd_size != cd_end:
        raise ArchiveError("central directory does not end where the end records begin",
                           min(cd_offset, cd_end), cd_end)
    if n_total > MAX_RECORDS or cd_size > length:
        raise ArchiveError("implausible central directory", cd_offset, cd_end)
    cd = read(cd_offset, cd_size)
    if len(cd) != cd_size:
        raise ArchiveError("central directory is cut short", cd_offset, cd_end)

    entries = []
    at = 0
    names: set[str] = set()
    for _ in range(n_total):
        f = _unpack("<4sHHHHHHIIIHHHHHII", cd, at, "central directory entry", cd_offset)
        (sig, made_by, needed, flags, method, mtime, mdate, crc, csize, usize, nlen, xlen, clen,
         dstart, iattr, eattr, lh_off) = f
        if sig != _CENTRAL:
            raise ArchiveError("central directory entry signature is wrong", cd_offset + at, cd_offset + at + 4)
        name_b = cd[at + 46 : at + 46 + nlen]
        extra = cd[at + 46 + nlen : at + 46 + nlen + xlen]
        if len(name_b) != nlen or len(extra) != xlen or clen or dstart or iattr or eattr or made_by:
            raise ArchiveError("central directory entry has fields torch never writes",
                               cd_offset + at, cd_offset + at + 46 + nlen + xlen + clen)
        try:
            name = name_b.decode("utf-8")
        except UnicodeDecodeError:
            raise ArchiveError("record name is not UTF-8", cd_offset + at, cd_offset + at + 46 + nlen) from None
        if name in names:
            raise ArchiveError(f"record {name!r} appears twice", cd_offset + at, cd_offset + at + 46 + nlen)
        names.add(name)
        usize, csize, lh_off = _zip64_values(extra, usize, csize, lh_off, cd_offset + at)
        entries.append((name, needed, flags, method, mtime, mdate, crc, csize, usize, lh_off))
        if crc_fields is not None:
            crc_fields[name] = [cd_offset + at + 16]
        at += 46 + nlen + xlen
    if at != cd_size:
        raise ArchiveError("central directory has trailing bytes", cd_offset + at, cd_end)

    records = []
    cursor = 0
    for name, needed, flags, method, mtime, mdate, crc, csize, usize, lh_off in sorted(entries, key=lambda e: e[9]):
        if lh_off != cursor:
            raise ArchiveError(f"record {name!r} does not start where the previous one ended "
                               f"({lh_off} vs {cursor})", min(lh_off, cursor), max(lh_off, cursor))
        if method != 0 or csize != usize or flags not in TORCH_FLAGS:
            raise ArchiveError(f"record {name!r} is compressed or uses flags torch never writes",
                               lh_off, lh_off + 30)
        head = read(lh_off, 30)
        sig, l_needed, l_flags, l_method, l_mtime, l_mdate, l_crc, l_csize, l_usize, l_nlen, l_xlen = _unpack(
            "<4sHHHHHIIIHH", head, 0, f"local header of {name!r}", lh_off
        )
        if sig != _LOCAL:
            raise ArchiveError(f"local header signature of {name!r} is wrong", lh_off, lh_off + 4)
        if (l_needed, l_flags, l_method, l_mtime, l_mdate) != (needed, flags, method, mtime, mdate):
            raise ArchiveError(f"local header of {name!r} disagrees with the central directory",
                               lh_off, lh_off + 30)
        var = read(lh_off + 30, l_nlen + l_xlen)
        if var[:l_nlen] != name.encode("utf-8") or len(var) != l_nlen + l_xlen:
            raise ArchiveError(f"local header name of {name!r} disagrees with the central directory",
                               lh_off + 30, lh_off + 30 + l_nlen)
        l_extra = var[l_nlen:]
        _check_local_extra(l_extra, name, lh_off + 30 + l_nlen)
        if flags & _FLAG_DESCRIPTOR:
            if (l_crc, l_csize, l_usize) not in ((0, 0, 0), (crc, csize & 0xFFFFFFFF, usize & 0xFFFFFFFF)):
                raise ArchiveError(f"local header sizes of {name!r} are not zero", lh_off + 14, lh_off + 26)
        elif l_crc != crc or (l_csize != csize and l_csize != 0xFFFFFFFF) or (
            l_usize != usize and l_usize != 0xFFFFFFFF
        ):
            raise ArchiveError(f"local header CRC/sizes of {name!r} disagree with the central directory",
                               lh_off + 14, lh_off + 26)
        if crc_fields is not None and (l_crc, l_csize, l_usize) != (0, 0, 0):
            crc_fields[name].append(lh_off + 14)
        data_at = lh_off + 30 + l_nlen + l_xlen
        cursor = data_at + usize
        if flags & _FLAG_DESCRIPTOR:
            if crc_fields is not None:
                crc_fields[name].append(cursor + 4)
            cursor = _check_descriptor(read, cursor, name, crc, usize)
        records.append(Record(name, lh_off, data_at, usize, crc))
    if cursor != cd_offset:
        raise ArchiveError("bytes between the last record and the central directory are unaccounted for",
                           min(cursor, cd_offset), max(cursor, cd_offset))
    prefixes = {r.name.split("/", 1)[0] for r in records if "/" in r.name}
    if len(prefixes) != 1 or any("/" not in r.name for r in records):
        raise ArchiveError("records do not share one top-level folder as torch.save writes them", 0, 0)
    return Archive(tuple(records), prefixes.pop())


class ArchiveTemplate:
    """One fully parsed item, against which items of the same length are matched byte for byte.

    An item matches when its bytes equal the template's outside the payloads and CRC fields of the varying records
    (learned while matching), and each varying record's CRC copies agree. :func:`parse_archive` would return the same
    records with the item's CRCs, so :meth:`match` skips parsing; non-varying records keep the template's CRCs.
    """

    def __init__(self, data: bytes, parsed: ParsedItem, crcs: list[int]) -> None:
        self.data = bytes(data)
        self.archive = parsed.archive
        #: Computed CRC-32 of each record of the template (the caller's, in archive order).
        self.crcs = list(crcs)
        self._fields = [tuple(parsed.crc_fields[r.name]) for r in self.archive.records]
        # Payload bytes the parse read (a tiny archive's end records are read with a margin) are compared too.
        reads = _merged(parsed.reads)
        self._payloads = [_subtract((r.data_offset, r.data_end), reads) for r in self.archive.records]
        self._structure = self._segments(frozenset(range(len(self.archive.records))))
        #: The records found to vary, and the segments outside them: replaced together (threads share it).
        self._state: tuple[frozenset[int], list[tuple[int, int, bytes]]] = (frozenset(), self._segments(frozenset()))
        self._lock = threading.Lock()

    def _segments(self, varying: frozenset[int]) -> list[tuple[int, int, bytes]]:
        """The ranges outside the payloads and CRC fields of the ``varying`` records, with the template's bytes."""
        holes = []
        for r in sorted(varying):
            holes.extend(self._payloads[r])
            holes.extend((at, at + 4) for at in self._fields[r])
        return [(lo, hi, self.data[lo:hi]) for lo, hi in _subtract((0, len(self.data)), _merged(holes))]

    def match(self, buf: bytes, base: int) -> tuple[Archive, list[int | None]] | None:
        """The archive at ``buf[base:base + len(template)]`` and per record its CRC where the template's holds
        (``None``:
        the caller computes it); ``None`` if the item does not match."""
        varying, same = self._state
        if not all(buf.startswith(seg, base + start) for start, _, seg in same):
            if not all(buf.startswith(seg, base + start) for start, _, seg in self._structure):
                return None
            # The same structure: learn which records vary (payload or CRC differs) and go on with them.
            data = self.data
            with self._lock:
                grown = set(self._state[0])
                for r, rec in enumerate(self.archive.records):
                    if r not in grown and (
                            not buf.startswith(data[rec.data_offset:rec.data_end], base + rec.data_offset)
                            or any(not buf.startswith(data[at:at + 4], base + at) for at in self._fields[r])):
                        grown.add(r)
                varying = frozenset(grown)
                self._state = (varying, self._segments(varying))
        if not varying:
            return self.archive, list(self.crcs)
        records = list(self.archive.records)
        crcs: list[int | None] = list(self.crcs)
        for r in varying:
            fields = self._fields[r]
            value = buf[base + fields[0]:base + fields[0] + 4]
            if any(not buf.startswith(value, base + at) for at in fields[1:]):
                return None  # the copies of its CRC disagree: parse_archive says where
            rec = records[r]
            records[r] = Record(rec.name, rec.header_offset, rec.data_offset, rec.size,
                                int.from_bytes(value, "little"))
            crcs[r] = None
        return Archive(tuple(records), self.archive.prefix, self.archive.index), crcs

    @property
    def varying(self) -> frozenset[int]:
        """The records found to vary between the items matched so far."""
        return self._state[0]


class TemplateCache:
    """Templates of one verification by item length, shared by its planning threads. A length's first item is only
    remembered; the template is built on the second. At most :attr:`LIMIT` lengths, of items up to
    :attr:`MAX_ITEM_BYTES`."""

    LIMIT = 256
    MAX_ITEM_BYTES = 64 << 10

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_length: dict[int, ArchiveTemplate | tuple[bytes, ParsedItem, list[int]]] = {}

    def get(self, length: int) -> ArchiveTemplate | None:
        found = self._by_length.get(length)
        return found if isinstance(found, ArchiveTemplate) else None

    def parsed(self, buf: bytes, base: int, length: int, parsed: ParsedItem, crcs: list[int]) -> None:
        """Note an item parsed in full (the item at ``buf[base:base + length]``)."""
        if length > self.MAX_ITEM_BYTES:
            return
        data = buf[base:base + length]
        with self._lock:
            found = self._by_length.get(length)
            if found is None:
                if len(self._by_length) < self.LIMIT:
                    self._by_length[length] = (bytes(data), parsed, crcs)
            elif isinstance(found, tuple):
                self._by_length[length] = ArchiveTemplate(*found)
            else:
                self._by_length[length] = ArchiveTemplate(data, parsed, crcs)  # the old one no longer fits


@dataclass(frozen=True, slots=True)
class ParsedItem:
    """An archive parsed from memory, with what :class:`ArchiveTemplate` needs to reuse the parse."""

    archive: Archive
    crc_fields: dict[str, list[int]]
    #: The byte ranges the parse read.
    reads: list[tuple[int, int]]


def parse_item(data: bytes | memoryview, base: int, length: int) -> ParsedItem:
    """:func:`parse_archive` of the item at ``data[base:base + length]``; raises :class:`ArchiveError`."""
    reads: list[tuple[int, int]] = []
    fields: dict[str, list[int]] = {}

    def read(offset: int, n: int) -> bytes:
        n = max(0, min(n, length - offset))
        reads.append((offset, offset + n))
        return bytes(data[base + offset:base + offset + n])

    archive = parse_archive(read, length, crc_fields=fields)
    return ParsedItem(archive, fields, reads)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted, with overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif lo < hi:
            out.append((lo, hi))
    return out


def _subtract(span: tuple[int, int], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``span`` minus the sorted, disjoint ranges ``cuts``."""
    out, cursor = [], span[0]
    for lo, hi in cuts:
        if hi <= cursor or lo >= span[1]:
            continue
        if lo > cursor:
            out.append((cursor, lo))
        cursor = max(cursor, hi)
    if cursor < span[1]:
        out.append((cursor, span[1]))
    return out


def _zip64_values(extra: bytes, usize: int, csize: int, lh_off: int, where: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + size]
        if tag == _ZIP64_EXTRA:
            it = (v[0] for v in struct.iter_unpack("<Q", body[: len(body) // 8 * 8]))
            try:
                if usize == 0xFFFFFFFF:
                    usize = next(it)
                if csize == 0xFFFFFFFF:
                    csize = next(it)
                if lh_off == 0xFFFFFFFF:
                    lh_off = next(it)
            except StopIteration:
                raise ArchiveError("zip64 extra field is too short", where, where + 46) from None
        else:
            raise ArchiveError(f"central directory extra field 0x{tag:04x} is not one torch writes", where,
                               where + 46)
        at += 4 + size
    if at != len(extra):
        raise ArchiveError("central directory extra field is malformed", where, where + 46)
    return usize, csize, lh_off


def _check_local_extra(extra: bytes, name: str, where: int) -> None:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + size]
        if len(body) != size:
            break
        if tag == _PAD_EXTRA:
            if body.count(_PAD_BYTE) != size:
                bad = next(i for i, b in enumerate(body) if b != _PAD_BYTE)
                raise ArchiveError(f"alignment padding of {name!r} has been altered",
                                   where + at + 4 + bad, where + at + 5 + bad)
        elif tag != _ZIP64_EXTRA:
            raise ArchiveError(f"local extra field 0x{tag:04x} of {name!r} is not one torch writes",
                               where + at, where + at + 4)
        at += 4 + size
    if at != len(extra):
        raise ArchiveError(f"local extra field of {name!r} is malformed", where, where + len(extra))


def _check_descriptor(read: Reader, at: int, name: str, crc: int, size: int) -> int:
    blob = read(at, 24)
    if blob[:4] == _DESCRIPTOR:
        if len(blob) >= 16 and struct.unpack_from("<III", blob, 4) == (crc, size, size):
            return at + 16
        if len(blob) >= 24 and struct.unpack_from("<IQQ", blob, 4) == (crc, size, size):
            return at + 24
    raise ArchiveError(f"data descriptor of {name!r} disagrees with the central directory", at, at + 16)
