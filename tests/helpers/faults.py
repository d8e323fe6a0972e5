"""Inject faults into a DCP checkpoint directory, for testing checkpoint verification.

Every injector changes the checkpoint in place and returns a :class:`Fault` describing exactly what it
changed: the file, the byte range (relative to the file's start), the bit, and where it is known the
item (FQN, chunk offsets), the zip record and the element of the tensor chunk (row-major).

This module reads ``.metadata`` meant for checkpoints the caller made. As a guard against reading back
a metadata file it planted itself (:func:`malicious_metadata`), its unpickler accepts only the globals
DCP metadata is made of (torch types, DCP metadata classes, ``pathlib`` paths) and refuses the rest.

The tests import it as ``from helpers import faults``; ``scripts/inject_fault.py`` is its command line.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import random
import re
import shlex
import struct
import zipfile
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PAGE = 4096

_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_EOCD_SIG = b"PK\x05\x06"
_EOCD64_SIG = b"PK\x06\x06"
_EOCD64_LOCATOR_SIG = b"PK\x06\x07"
_LOCAL_HEADER_LEN = 30
_CENTRAL_HEADER_LEN = 46
_EOCD_LEN = 22
_EOCD64_LOCATOR_LEN = 20


class InjectError(RuntimeError):
    """The requested fault cannot be applied to this checkpoint."""


@dataclass
class Fault:
    """What an injector changed. Byte offsets are relative to the start of ``file``."""

    kind: str
    file: str | None = None
    byte_offset: int | None = None
    bit: int | None = None
    byte_range: tuple[int, int] | None = None
    fqn: str | None = None
    chunk_offsets: tuple[int, ...] | None = None
    record: str | None = None
    element: int | None = None
    element_range: tuple[int, int] | None = None
    files: tuple[str, ...] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}


# --------------------------------------------------------------------------------------------------------
# Reading the checkpoint layout


@dataclass(frozen=True)
class Item:
    """One storage item: a byte range of a ``.distcp`` file holding one chunk or one non-tensor value."""

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    file: str
    offset: int
    length: int
    kind: str  # "tensor" or "bytes"
    dtype: Any = None  # torch.dtype for tensor items
    chunk_sizes: tuple[int, ...] | None = None
    transformed: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize if self.dtype is not None else 1

    def signature(self) -> tuple[Any, ...]:
        """Everything about the item's layout except its name."""
        return (self.offset, self.length, self.kind, str(self.dtype), self.chunk_sizes, self.transformed)


@dataclass(frozen=True)
class Record:
    """One zip record inside an item; all offsets are absolute in the file."""

    name: str
    local_header: int
    data_start: int
    data_len: int
    crc: int
    central_header: int

    @property
    def data_end(self) -> int:
        return self.data_start + self.data_len


def metadata_files(ckpt: str | os.PathLike[str]) -> list[Path]:
    """The global ``.metadata``, or else every per-rank ``__N.metadata`` in rank order."""
    root = Path(ckpt)
    glob = root / ".metadata"
    if glob.exists():
        return [glob]
    per_rank = [p for p in root.iterdir() if re.fullmatch(r"__\d+\.metadata", p.name)]
    return sorted(per_rank, key=lambda p: int(p.name[2:].split(".")[0]))


_SAFE_BUILTINS = frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "complex", "bytearray"})


class _MetadataUnpickler(pickle.Unpickler):
    """Loads DCP metadata; refuses any global outside what DCP metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module in ("torch", "torch.serialization", "pathlib", "collections", "copyreg")
            or module.startswith("torch.distributed.checkpoint")
            or (module == "builtins" and name in _SAFE_BUILTINS)
        )
        if not allowed or (module == "torch.serialization" and name != "_get_layout"):
            raise InjectError(f"metadata refers to {module}.{name}, which DCP metadata never does")
        return super().find_class(module, name)


def load_metadata(ckpt: str | os.PathLike[str]) -> list[Any]:
    """Unpickle every metadata file of a checkpoint (allowlisted globals only)."""
    files = metadata_files(ckpt)
    if not files:
        raise InjectError(f"{ckpt}: no .metadata and no __N.metadata")
    out = []
    for p in files:
        with open(p, "rb") as fh:
            try:
                out.append(_MetadataUnpickler(fh).load())
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
                raise InjectError(f"{p.name}: not readable DCP metadata: {exc}") from exc
    return out


def items(ckpt: str | os.PathLike[str]) -> list[Item]:
    """All storage items of the checkpoint, sorted by file then offset."""
    found: dict[tuple[str, tuple[int, ...] | None, str, int], Item] = {}
    for md in load_metadata(ckpt):
        for index, info in md.storage_data.items():
            sd_meta = md.state_dict_metadata.get(index.fqn)
            offsets = tuple(index.offset) if index.offset is not None else None
            chunks = getattr(sd_meta, "chunks", None)
            if chunks is not None and offsets is not None:
                sizes = next((tuple(c.sizes) for c in chunks if tuple(c.offsets) == offsets), None)
                item = Item(
                    fqn=index.fqn,
                    chunk_offsets=offsets,
                    file=info.relative_path,
                    offset=info.offset,
                    length=info.length,
                    kind="tensor",
                    dtype=sd_meta.properties.dtype,
                    chunk_sizes=sizes,
                    transformed=bool(getattr(info, "transform_descriptors", None)),
                )
            else:
                item = Item(
                    fqn=index.fqn,
                    chunk_offsets=None,
                    file=info.relative_path,
                    offset=info.offset,
                    length=info.length,
                    kind="bytes",
                    transformed=bool(getattr(info, "transform_descriptors", None)),
                )
            found[(item.fqn, item.chunk_offsets, item.file, item.offset)] = item
    return sorted(found.values(), key=lambda it: (it.file, it.offset, it.fqn))


def _read(ckpt: str | os.PathLike[str], file: str, start: int, length: int) -> bytes:
    with open(Path(ckpt) / file, "rb") as fh:
        fh.seek(start)
        return fh.read(length)


def zip_records(ckpt: str | os.PathLike[str], item: Item) -> list[Record]:
    """The zip records of one ``torch.save`` item. Raises :class:`InjectError` if it is not a zip."""
    blob = _read(ckpt, item.file, item.offset, item.length)
    try:
        zf = zipfile.ZipFile(io.BytesIO(blob))
    except zipfile.BadZipFile as exc:
        raise InjectError(f"{item.fqn}: item in {item.file} is not a zip archive") from exc
    central: dict[str, int] = {}
    pos = zf.start_dir
    while blob[pos : pos + 4] == _CENTRAL_SIG:
        n, m, k = struct.unpack_from("<HHH", blob, pos + 28)
        name = blob[pos + _CENTRAL_HEADER_LEN : pos + _CENTRAL_HEADER_LEN + n].decode("utf-8")
        central[name] = pos
        pos += _CENTRAL_HEADER_LEN + n + m + k
    out = []
    for info in zf.infolist():
        lh = info.header_offset
        if blob[lh : lh + 4] != _LOCAL_SIG:
            raise InjectError(f"{item.fqn}: no local header at {lh}")
        n, m = struct.unpack_from("<HH", blob, lh + 26)
        out.append(
            Record(
                name=info.filename,
                local_header=item.offset + lh,
                data_start=item.offset + lh + _LOCAL_HEADER_LEN + n + m,
                data_len=info.compress_size,
                crc=info.CRC,
                central_header=item.offset + central[info.filename],
            )
        )
    return out


_LOCAL_FIELDS = ((0, 4, "signature"), (4, 6, "version needed"), (6, 8, "flags"), (8, 10, "compression method"),
                 (10, 12, "mod time"), (12, 14, "mod date"), (14, 18, "CRC-32"), (18, 22, "compressed size"),
                 (22, 26, "uncompressed size"), (26, 28, "name length"), (28, 30, "extra length"))
_CENTRAL_FIELDS = ((0, 4, "signature"), (4, 6, "version made by"), (6, 8, "version needed"), (8, 10, "flags"),
                   (10, 12, "compression method"), (12, 14, "mod time"), (14, 16, "mod date"), (16, 20, "CRC-32"),
                   (20, 24, "compressed size"), (24, 28, "uncompressed size"), (28, 30, "name length"),
                   (30, 32, "extra length"), (32, 34, "comment length"), (34, 36, "disk number"),
                   (36, 38, "internal attributes"), (38, 42, "external attributes"),
                   (42, 46, "local header offset"))
_EOCD64_FIELDS = ((0, 4, "signature"), (4, 12, "record size"), (12, 14, "version made by"),
                  (14, 16, "version needed"), (16, 20, "disk number"), (20, 24, "central directory disk"),
                  (24, 32, "entries on disk"), (32, 40, "entries"), (40, 48, "central directory size"),
                  (48, 56, "central directory offset"))
_LOCATOR_FIELDS = ((0, 4, "signature"), (4, 8, "disk"), (8, 16, "zip64 end record offset"), (16, 20, "disks"))
_EOCD_FIELDS = ((0, 4, "signature"), (4, 6, "disk number"), (6, 8, "central directory disk"),
                (8, 10, "entries on disk"), (10, 12, "entries"), (12, 16, "central directory size"),
                (16, 20, "central directory offset"), (20, 22, "comment length"))


def _field(fields: tuple[tuple[int, int, str], ...], rel: int) -> str:
    return next((name for lo, hi, name in fields if lo <= rel < hi), f"byte {rel}")


def zip_field_at(ckpt: str | os.PathLike[str], item: Item, offset: int) -> str:
    """Name the zip structure at absolute ``offset`` of ``item.file`` (for messages about a byte)."""
    records = sorted(zip_records(ckpt, item), key=lambda r: r.local_header)
    blob = _read(ckpt, item.file, item.offset, item.length)
    rel = offset - item.offset
    for i, rec in enumerate(records):
        lh = rec.local_header - item.offset
        n, m = struct.unpack_from("<HH", blob, lh + 26)
        if lh <= rel < lh + _LOCAL_HEADER_LEN:
            return f"local header of {rec.name}: {_field(_LOCAL_FIELDS, rel - lh)}"
        if lh + _LOCAL_HEADER_LEN <= rel < lh + _LOCAL_HEADER_LEN + n:
            return f"local header of {rec.name}: file name"
        if lh + _LOCAL_HEADER_LEN + n <= rel < lh + _LOCAL_HEADER_LEN + n + m:
            return f"local header of {rec.name}: extra field (alignment padding)"
        if rec.data_start - item.offset <= rel < rec.data_end - item.offset:
            return f"data of {rec.name}"
        nxt = records[i + 1].local_header - item.offset if i + 1 < len(records) else None
        dd = rec.data_end - item.offset
        if nxt is None:
            nxt = min((r.central_header for r in records), default=item.end) - item.offset
        if dd <= rel < nxt:
            names = ("signature", "CRC-32", "compressed size", "uncompressed size")
            width = 8 if nxt - dd == 24 else 4
            spans = [(0, 4), (4, 8), (8, 8 + width), (8 + width, 8 + 2 * width)]
            where = next((names[j] for j, (lo, hi) in enumerate(spans) if lo <= rel - dd < hi), "byte")
            return f"data descriptor of {rec.name}: {where}"
    for rec in records:
        ch = rec.central_header - item.offset
        n, m, k = struct.unpack_from("<HHH", blob, ch + 28)
        if ch <= rel < ch + _CENTRAL_HEADER_LEN:
            return f"central directory entry of {rec.name}: {_field(_CENTRAL_FIELDS, rel - ch)}"
        if ch + _CENTRAL_HEADER_LEN <= rel < ch + _CENTRAL_HEADER_LEN + n + m + k:
            return f"central directory entry of {rec.name}: name/extra/comment"
    eocd = item.length - _EOCD_LEN
    if eocd <= rel:
        return f"end record: {_field(_EOCD_FIELDS, rel - eocd)}"
    loc = eocd - _EOCD64_LOCATOR_LEN
    if loc <= rel:
        return f"zip64 locator: {_field(_LOCATOR_FIELDS, rel - loc)}"
    rec64 = blob.rfind(_EOCD64_SIG, 0, loc + 1)
    if 0 <= rec64 <= rel:
        return f"zip64 end record: {_field(_EOCD64_FIELDS, rel - rec64)}"
    return f"item byte {rel} (outside every known zip structure)"


def is_zip_item(ckpt: str | os.PathLike[str], item: Item) -> bool:
    try:
        zip_records(ckpt, item)
    except InjectError:
        return False
    return True


def payload_record(records: Sequence[Record]) -> Record:
    """The tensor storage record (``archive/data/0``) among an item's records."""
    for rec in records:
        if re.fullmatch(r"[^/]+/data/0", rec.name):
            return rec
    raise InjectError("no data/0 record in item")


def tensor_zip_items(ckpt: str | os.PathLike[str]) -> list[Item]:
    """Tensor items stored as ``torch.save`` zips with a non-empty payload (the CRC-checkable ones)."""
    out = []
    for it in items(ckpt):
        if it.kind != "tensor" or it.transformed:
            continue
        try:
            rec = payload_record(zip_records(ckpt, it))
        except InjectError:
            continue
        if rec.data_len > 0:
            out.append(it)
    return out


def bytes_zip_items(ckpt: str | os.PathLike[str]) -> list[Item]:
    return [it for it in items(ckpt) if it.kind == "bytes" and not it.transformed and is_zip_item(ckpt, it)]


def _rng(rng: random.Random | int | None) -> random.Random | None:
    if rng is None or isinstance(rng, random.Random):
        return rng
    return random.Random(rng)


def _distcp_files(ckpt: str | os.PathLike[str]) -> list[str]:
    return sorted(p.name for p in Path(ckpt).iterdir() if p.name.endswith(".distcp"))


def _largest_distcp(ckpt: str | os.PathLike[str]) -> str:
    files = _distcp_files(ckpt)
    if not files:
        raise InjectError(f"{ckpt}: no .distcp files")
    return max(files, key=lambda f: ((Path(ckpt) / f).stat().st_size, f))


# --------------------------------------------------------------------------------------------------------
# Injectors


def flip_bit(path: str | os.PathLike[str], file: str, byte_offset: int, bit: int) -> Fault:
    """Flip bit ``bit`` (0 = least significant) of byte ``byte_offset`` of ``path/file``."""
    if not 0 <= bit < 8:
        raise InjectError(f"bit must be in [0, 8), got {bit}")
    target = Path(path) / file
    with open(target, "r+b") as fh:
        fh.seek(byte_offset)
        old = fh.read(1)
        if len(old) != 1:
            raise InjectError(f"{file}: offset {byte_offset} is past the end")
        new = old[0] ^ (1 << bit)
        fh.seek(byte_offset)
        fh.write(bytes([new]))
    return Fault(
        kind="bit-flip",
        file=file,
        byte_offset=byte_offset,
        bit=bit,
        byte_range=(byte_offset, byte_offset + 1),
        details={"old": old[0], "new": new},
    )


def _locate(fault: Fault, item: Item, rec: Record) -> Fault:
    fault.fqn = item.fqn
    fault.chunk_offsets = item.chunk_offsets
    fault.record = rec.name
    fault.details.update(item_offset=item.offset, item_length=item.length)
    return fault


def _pick_item(candidates: list[Item], fqn: str | None, rng: random.Random | None, what: str) -> Item:
    if fqn is not None:
        candidates = [it for it in candidates if it.fqn == fqn]
        if not candidates:
            raise InjectError(f"no {what} item with FQN {fqn!r}")
    if not candidates:
        raise InjectError(f"checkpoint has no {what} items")
    if rng is not None:
        return rng.choice(candidates)
    return max(candidates, key=lambda it: (it.length, it.fqn))


def flip_in_tensor_payload(
    ckpt: str | os.PathLike[str],
    fqn: str | None = None,
    element: int | None = None,
    bit: int | None = None,
    rng: random.Random | int | None = None,
) -> Fault:
    """Flip one bit of one element of a tensor chunk's stored payload.

    ``element`` counts elements of the chunk row-major; ``bit`` counts bits of the element's
    little-endian value (0 = least significant). Defaults: the largest tensor item, its middle element
    and a high bit, or random choices when ``rng`` (a ``random.Random`` or a seed) is given.
    """
    rng = _rng(rng)
    item = _pick_item(tensor_zip_items(ckpt), fqn, rng, "tensor")
    rec = payload_record(zip_records(ckpt, item))
    size = item.itemsize
    numel = rec.data_len // size
    if element is None:
        element = rng.randrange(numel) if rng is not None else numel // 2
    if not 0 <= element < numel:
        raise InjectError(f"{item.fqn}: element {element} outside [0, {numel})")
    if bit is None:
        bit = rng.randrange(size * 8) if rng is not None else size * 8 - 2
    if not 0 <= bit < size * 8:
        raise InjectError(f"{item.fqn}: bit {bit} outside [0, {size * 8})")
    byte = rec.data_start + element * size + bit // 8
    fault = flip_bit(ckpt, item.file, byte, bit % 8)
    fault.kind = "payload-bit-flip"
    fault.element = element
    fault.element_range = (element, element + 1)
    fault.details["element_bit"] = bit
    fault.details["numel"] = numel
    return _locate(fault, item, rec)


def flip_payload_byte(ckpt: str | os.PathLike[str], item: Item, byte_in_payload: int, bit: int) -> Fault:
    """Flip bit ``bit`` of byte ``byte_in_payload`` (counted from the start of the tensor payload)."""
    rec = payload_record(zip_records(ckpt, item))
    if not 0 <= byte_in_payload < rec.data_len:
        raise InjectError(f"{item.fqn}: payload byte {byte_in_payload} outside [0, {rec.data_len})")
    fault = flip_bit(ckpt, item.file, rec.data_start + byte_in_payload, bit)
    fault.kind = "payload-bit-flip"
    fault.element = byte_in_payload // item.itemsize
    fault.element_range = (fault.element, fault.element + 1)
    return _locate(fault, item, rec)


def rewrite_payload_valid_crc(ckpt: str | os.PathLike[str], fqn: str | None = None, element: int = 0,
                              value: bytes | None = None, file: str | None = None) -> Fault:
    """Change one element of a tensor payload AND rewrite the record's CRC-32 (central directory and data
    descriptor) to match, as a buggy or malicious re-save would: every self-check of the item still passes.
    """
    candidates = [it for it in tensor_zip_items(ckpt) if file is None or it.file == file]
    item = _pick_item(candidates, fqn, None, "tensor")
    rec = payload_record(zip_records(ckpt, item))
    size = item.itemsize
    start = rec.data_start + element * size
    target = Path(ckpt) / item.file
    with open(target, "r+b") as fh:
        fh.seek(start)
        old = fh.read(size)
        new = value if value is not None else bytes(b ^ 0x5A for b in old)
        if len(new) != size or new == old:
            raise InjectError("replacement must be a different value of the element's size")
        fh.seek(start)
        fh.write(new)
        fh.seek(rec.data_start)
        crc = zlib.crc32(fh.read(rec.data_len))
        fh.seek(rec.central_header + 16)  # CRC-32 field of the central directory entry
        fh.write(struct.pack("<I", crc))
        fh.seek(rec.data_end)
        if fh.read(4) == b"PK\x07\x08":  # data descriptor: signature, then CRC-32
            fh.write(struct.pack("<I", crc))
    fault = Fault(kind="silent-rewrite", file=item.file, byte_offset=start, byte_range=(start, start + size),
                  element=element, element_range=(element, element + 1), details={"new_crc": crc})
    return _locate(fault, item, rec)


def flip_in_bytes_item(ckpt: str | os.PathLike[str], fqn: str | None = None, bit: int = 0) -> Fault:
    """Flip a bit in the middle of the pickled value of a non-tensor item (its ``data.pkl`` record)."""
    candidates = bytes_zip_items(ckpt)
    if fqn is None:
        preferred = [it for it in candidates if it.fqn == "step"]
        candidates = preferred or candidates[:1]
    item = _pick_item(candidates, fqn, None, "non-tensor")
    rec = next((r for r in zip_records(ckpt, item) if r.name.endswith("/data.pkl")), None)
    if rec is None or rec.data_len == 0:
        raise InjectError(f"{item.fqn}: no data.pkl record")
    fault = flip_bit(ckpt, item.file, rec.data_start + rec.data_len // 2, bit)
    fault.kind = "bytes-item-bit-flip"
    return _locate(fault, item, rec)


ZIP_HEADER_FIELDS = ("local", "central", "eocd", "eocd64")


def flip_in_zip_header(ckpt: str | os.PathLike[str], which: str = "local", fqn: str | None = None) -> Fault:
    """Flip a bit in a zip structure field that readers rely on.

    ``local``: the last byte of the record name in the local header of the payload record (``data/0``
    of a tensor item, ``data.pkl`` of a non-tensor item), so local and central names disagree.
    ``central``: the CRC-32 field of that record's central directory entry.
    ``eocd``: the signature of the end-of-central-directory record.
    ``eocd64``: the central-directory offset in the zip64 end record (falls back to the classic one).
    Defaults to the largest tensor item, or the first non-tensor zip item when there is none.
    """
    if which not in ZIP_HEADER_FIELDS:
        raise InjectError(f"which must be one of {ZIP_HEADER_FIELDS}, got {which!r}")
    tensors = tensor_zip_items(ckpt)
    if fqn is not None:
        pool = [it for it in tensors + bytes_zip_items(ckpt) if it.fqn == fqn]
    else:
        pool = tensors or bytes_zip_items(ckpt)[:1]
    item = _pick_item(pool, fqn, None, "zip")
    records = zip_records(ckpt, item)
    rec = payload_record(records) if item.kind == "tensor" else next(
        r for r in records if r.name.endswith("/data.pkl")
    )
    blob = _read(ckpt, item.file, item.offset, item.length)
    if which == "local":
        (n,) = struct.unpack_from("<H", blob, rec.local_header - item.offset + 26)
        byte, bit, what = rec.local_header + _LOCAL_HEADER_LEN + n - 1, 0, "local header file name"
    elif which == "central":
        byte, bit, what = rec.central_header + 16, 3, "central directory CRC-32"
    else:
        eocd = item.length - _EOCD_LEN
        if blob[eocd : eocd + 4] != _EOCD_SIG:
            eocd = blob.rfind(_EOCD_SIG)
        if eocd < 0:
            raise InjectError(f"{item.fqn}: no end-of-central-directory record")
        if which == "eocd":
            byte, bit, what = item.offset + eocd + 1, 0, "end-of-central-directory signature"
        else:
            loc = eocd - _EOCD64_LOCATOR_LEN
            if loc >= 0 and blob[loc : loc + 4] == _EOCD64_LOCATOR_SIG:
                (rec64,) = struct.unpack_from("<Q", blob, loc + 8)
                if blob[rec64 : rec64 + 4] != _EOCD64_SIG:
                    raise InjectError(f"{item.fqn}: zip64 locator points at no zip64 end record")
                byte, bit, what = item.offset + rec64 + 48, 2, "zip64 end record central directory offset"
            else:
                byte, bit, what = item.offset + eocd + 16, 2, "end record central directory offset"
    fault = flip_bit(ckpt, item.file, byte, bit)
    fault.kind = f"zip-header-bit-flip-{which}"
    fault.details["field"] = what
    return _locate(fault, item, rec)


def truncate(ckpt: str | os.PathLike[str], file: str | None = None, nbytes: int | None = None) -> Fault:
    """Cut ``nbytes`` off the end of ``file`` (default: the largest ``.distcp`` file).

    With ``nbytes=None`` the cut is just deep enough for the last item of the file to lose its final
    byte (one byte for ordinary files; more where the file carries data past its last item).
    """
    file = file or _largest_distcp(ckpt)
    target = Path(ckpt) / file
    size = target.stat().st_size
    in_file = [it for it in items(ckpt) if it.file == file] if file.endswith(".distcp") else []
    if nbytes is None:
        last_end = max((it.end for it in in_file), default=size)
        nbytes = size - last_end + 1
    if not 0 < nbytes <= size:
        raise InjectError(f"{file}: cannot cut {nbytes} bytes from {size}")
    new_size = size - nbytes
    os.truncate(target, new_size)
    cut = [it.fqn for it in in_file if it.end > new_size]
    return Fault(
        kind="truncate",
        file=file,
        byte_offset=new_size,
        byte_range=(new_size, size),
        fqn=cut[-1] if cut else None,
        details={"old_size": size, "new_size": new_size, "fqns_cut": cut},
    )


def delete_file(ckpt: str | os.PathLike[str], file: str | None = None) -> Fault:
    """Delete one file of the checkpoint (default: the largest ``.distcp`` file)."""
    file = file or _largest_distcp(ckpt)
    in_file = [it.fqn for it in items(ckpt) if it.file == file] if metadata_files(ckpt) else []
    (Path(ckpt) / file).unlink()
    return Fault(kind="delete-file", file=file, details={"fqns": in_file})


def add_extra_file(ckpt: str | os.PathLike[str], name: str = "__0_99.distcp", data: bytes | None = None) -> Fault:
    """Create a file the metadata does not reference."""
    target = Path(ckpt) / name
    if target.exists():
        raise InjectError(f"{name} already exists")
    payload = data if data is not None else b"stray bytes not referenced by any metadata\n" * 8
    target.write_bytes(payload)
    return Fault(kind="extra-file", file=name, byte_range=(0, len(payload)))


def append_bytes(ckpt: str | os.PathLike[str], file: str | None = None, data: bytes | None = None) -> Fault:
    """Append bytes that no item covers to the end of ``file`` (default: the largest ``.distcp``)."""
    file = file or _largest_distcp(ckpt)
    target = Path(ckpt) / file
    payload = data if data is not None else b"\xab" * 100
    size = target.stat().st_size
    with open(target, "ab") as fh:
        fh.write(payload)
    return Fault(kind="append-bytes", file=file, byte_offset=size, byte_range=(size, size + len(payload)))


def same_size_pairs(ckpt: str | os.PathLike[str]) -> list[tuple[str, str, bool]]:
    """Pairs of ``.distcp`` files with equal size and different bytes, with whether their items differ.

    Items "differ" when their layouts (offsets, lengths, kinds, tensor dtypes or chunk shapes) differ;
    a swap of two files whose items match in all of these is invisible without a manifest.
    """
    root = Path(ckpt)
    by_file: dict[str, list[tuple[Any, ...]]] = {}
    for it in items(ckpt):
        by_file.setdefault(it.file, []).append(it.signature())
    by_size: dict[int, list[str]] = {}
    for name in _distcp_files(ckpt):
        by_size.setdefault((root / name).stat().st_size, []).append(name)
    pairs = []
    for size in sorted(by_size):
        names = by_size[size]
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if (root / a).read_bytes() != (root / b).read_bytes():
                    pairs.append((a, b, sorted(by_file.get(a, [])) != sorted(by_file.get(b, []))))
    return pairs


def swap_same_size_files(
    ckpt: str | os.PathLike[str],
    pair: tuple[str, str] | None = None,
    prefer_different_items: bool = True,
) -> Fault:
    """Exchange the contents of two equal-size ``.distcp`` files whose bytes differ.

    Prefers a pair whose items differ in layout, dtype or shape (see :func:`same_size_pairs`).
    Raises :class:`InjectError` when there is no such pair of files at all.
    """
    candidates = same_size_pairs(ckpt)
    if pair is not None:
        chosen = next((c for c in candidates if {c[0], c[1]} == set(pair)), None)
        if chosen is None:
            raise InjectError(f"{pair}: not two equal-size files with different contents")
    else:
        if not candidates:
            raise InjectError(f"{ckpt}: no two .distcp files of equal size with different contents")
        differing = [c for c in candidates if c[2]]
        chosen = (differing if prefer_different_items and differing else candidates)[0]
    a, b, differ = chosen
    pa, pb = Path(ckpt) / a, Path(ckpt) / b
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)
    return Fault(kind="swap-files", files=(a, b), details={"size": len(da), "items_differ": differ})


def zero_page(ckpt: str | os.PathLike[str], file: str | None = None, offset: int | None = None) -> Fault:
    """Zero a 4 KiB page of a file, as a lost or torn page would.

    Default: the first page-aligned page (in file offsets) that lies wholly inside the largest tensor
    payload (in ``file`` if given) and holds a non-zero byte. With ``offset`` zero
    ``[offset, offset + 4096)`` of ``file`` (default: the largest ``.distcp`` file).
    """
    located: tuple[Item, Record] | None = None
    if offset is None:
        pool = [it for it in tensor_zip_items(ckpt) if file is None or it.file == file]
        for item in sorted(pool, key=lambda it: (-it.length, it.fqn)):
            rec = payload_record(zip_records(ckpt, item))
            start = -(-rec.data_start // PAGE) * PAGE
            while start + PAGE <= rec.data_end:
                if any(_read(ckpt, item.file, start, PAGE)):
                    located, offset, file = (item, rec), start, item.file
                    break
                start += PAGE
            if located is not None:
                break
        if located is None or offset is None:
            raise InjectError(f"{ckpt}: no tensor payload holds a whole non-zero 4 KiB page")
    else:
        file = file or _largest_distcp(ckpt)
        for item in tensor_zip_items(ckpt):
            if item.file != file:
                continue
            rec = payload_record(zip_records(ckpt, item))
            if rec.data_start < offset + PAGE and offset < rec.data_end:
                located = (item, rec)
                break
    target = Path(ckpt) / file
    size = target.stat().st_size
    end = min(offset + PAGE, size)
    with open(target, "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes(end - offset))
    fault = Fault(kind="zero-page", file=file, byte_offset=offset, byte_range=(offset, end))
    if located is not None:
        item, rec = located
        first = max(offset, rec.data_start) - rec.data_start
        last = min(end, rec.data_end) - rec.data_start
        fault.element_range = (first // item.itemsize, -(-last // item.itemsize))
        fault.element = fault.element_range[0]
        _locate(fault, item, rec)
    return fault


def delete_metadata(ckpt: str | os.PathLike[str]) -> Fault:
    """Delete ``.metadata`` and every ``__N.metadata``."""
    root = Path(ckpt)
    gone = [p.name for p in root.iterdir() if p.name == ".metadata" or re.fullmatch(r"__\d+\.metadata", p.name)]
    for name in gone:
        (root / name).unlink()
    if not gone:
        raise InjectError(f"{ckpt}: no metadata file to delete")
    return Fault(kind="delete-metadata", file=sorted(gone)[0], files=tuple(sorted(gone)))


class _Payload:
    """Pickles as a call of ``func(*args)``. Only ever pickled here, never unpickled."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


MALICIOUS_VIA = ("open", "system", "eval")


def malicious_metadata(
    ckpt: str | os.PathLike[str],
    canary_path: str | os.PathLike[str],
    via: str = "open",
    nested: bool = False,
) -> Fault:
    """Replace the (first) metadata file with a pickle that would create ``canary_path`` when loaded.

    ``via``: ``open`` calls ``open(canary, "w")``, ``system`` runs ``touch canary`` through
    ``os.system``, ``eval`` evaluates an ``open(...)`` expression. With ``nested`` the payload sits
    inside the real ``Metadata`` object (in ``planner_data``) instead of being the whole pickle.
    The pickle is written, never loaded. ``details["global"]`` names the forbidden global.
    """
    canary = os.fspath(canary_path)
    if via == "open":
        payload = _Payload(builtins.open, (canary, "w"))
    elif via == "system":
        payload = _Payload(os.system, (f"touch {shlex.quote(canary)}",))
    elif via == "eval":
        payload = _Payload(builtins.eval, (f"open({canary!r}, 'w')",))
    else:
        raise InjectError(f"via must be one of {MALICIOUS_VIA}, got {via!r}")
    target = metadata_files(ckpt)[0]
    if nested:
        md = load_metadata(ckpt)[0]
        md.planner_data = {"innocent-looking": payload}
        blob = pickle.dumps(md)
    else:
        blob = pickle.dumps(payload)
    target.write_bytes(blob)
    name = f"{payload.func.__module__}.{payload.func.__name__}"
    return Fault(
        kind="malicious-metadata",
        file=target.name,
        details={"global": name, "canary": canary, "via": via, "nested": nested},
    )


def edit_metadata(ckpt: str | os.PathLike[str], edit: Callable[[Any], str], index: int = 0) -> Fault:
    """Load metadata file ``index``, let ``edit(metadata)`` change it (returning a description), save it.

    The result is still an ordinary, well-formed DCP metadata pickle.
    """
    target = metadata_files(ckpt)[index]
    md = load_metadata(ckpt)[index]
    what = edit(md)
    target.write_bytes(pickle.dumps(md))
    return Fault(kind="edit-metadata", file=target.name, details={"edit": what})
