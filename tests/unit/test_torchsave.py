"""torch.save archive parsing: agrees with zipfile on real archives, and misses no flipped bit."""

from __future__ import annotations

import io
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch

from ckptverify.errors import ArchiveError
from ckptverify.safeparse.torchsave import item_header
from ckptverify.safeparse.zipwalk import parse_archive


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _reader(blob: bytes):
    return lambda offset, n: blob[offset : offset + max(0, n)]


TENSORS = [
    torch.randn(3, 4),
    torch.tensor(2.5, dtype=torch.float64),
    torch.zeros(0, 5),
    torch.arange(10, dtype=torch.int16),
    torch.ones(7, dtype=torch.bool),
    torch.randn(4, dtype=torch.complex64),
    torch.randn(5).to(torch.bfloat16),
    torch.randn(6).to(torch.float8_e4m3fn),
    torch.arange(4, dtype=torch.int32).to(torch.uint16),
    torch.randn(3, 4).t(),
]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_records_agree_with_zipfile_and_header_with_the_tensor(tensor):
    blob = _saved(tensor)
    archive = parse_archive(_reader(blob), len(blob))
    zf = zipfile.ZipFile(io.BytesIO(blob))
    assert [r.name for r in sorted(archive.records, key=lambda r: r.name)] == sorted(zf.namelist())
    for rec in archive.records:
        info = zf.getinfo(rec.name)
        assert (rec.size, rec.crc) == (info.file_size, info.CRC)
        assert blob[rec.data_offset : rec.data_end] == zf.read(rec.name)
        assert zlib.crc32(blob[rec.data_offset : rec.data_end]) == rec.crc
    assert archive.prefix == "archive"
    header = item_header(zf.read("archive/data.pkl"))
    assert header.dtype == str(tensor.dtype).removeprefix("torch.")
    assert header.size == tuple(tensor.shape)
    assert header.stride == tuple(tensor.stride())
    assert header.storage_offset == tensor.storage_offset()
    assert header.is_row_major == tensor.is_contiguous()


def _detected(blob: bytes) -> bool:
    try:
        archive = parse_archive(_reader(blob), len(blob))
    except ArchiveError:
        return True
    return any(zlib.crc32(blob[r.data_offset : r.data_end]) != r.crc for r in archive.records)


@pytest.mark.parametrize("value", [torch.randn(2, 3), {"step": 7}], ids=["tensor", "bytes-item"])
def test_every_single_bit_flip_anywhere_in_an_archive_is_detected(value):
    blob = bytearray(_saved(value))
    assert not _detected(bytes(blob))
    missed = []
    for byte in range(len(blob)):
        for bit in range(8):
            blob[byte] ^= 1 << bit
            if not _detected(bytes(blob)):
                missed.append((byte, bit))
            blob[byte] ^= 1 << bit
    assert missed == [], f"{len(missed)} undetected flips, first at (byte, bit) {missed[:5]}"


def test_truncated_or_extended_archives_are_malformed():
    blob = _saved(torch.randn(8))
    for bad in (blob[:-1], blob[1:], blob + b"\0", b"\0" + blob, blob[: len(blob) // 2], b""):
        with pytest.raises(ArchiveError):
            parse_archive(_reader(bad), len(bad))


def test_item_header_refuses_anything_but_a_tensor():
    evil = _saved({"a": 1})
    with pytest.raises(pickle.UnpicklingError):
        item_header(zipfile.ZipFile(io.BytesIO(evil)).read("archive/data.pkl"))

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with pytest.raises(pickle.UnpicklingError, match="print"):
        item_header(pickle.dumps(Evil(), protocol=2))


def _data_pkl(value) -> bytes:
    z = zipfile.ZipFile(io.BytesIO(_saved(value)))
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


@pytest.mark.parametrize("hostile", [
    b"\x80\x02ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypeX\x04\x00\x00\x00int8sb.",  # dict state
    b"\x80\x02ctorch\nFloatStorage\nN}X\x05\x00\x00\x00valueX\x04\x00\x00\x00int8s\x86b.",  # slot state
    b"\x80\x02ccollections\nOrderedDict\nN}X\x07\x00\x00\x00__len__K\x01s\x86b.",  # a stand-in class
    b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}X\x05\x00\x00\x00_callK\x01s\x86b.",
])
def test_hostile_data_pkl_cannot_change_how_the_next_is_read(hostile):
    clean = _data_pkl(torch.randn(4, 2))
    before = item_header(clean)
    assert before.dtype == "float32" and before.storage_numel == 8
    with pytest.raises(pickle.UnpicklingError):
        item_header(hostile)
    assert item_header(clean) == before


def test_a_huge_memo_index_in_data_pkl_allocates_nothing():
    # LONG_BINPUT 2^30: the C unpickler would zero-fill 16 GiB of memo slots for this 30-byte record.
    data = b"\x80\x02ctorch\nFloatStorage\nr" + (2**30).to_bytes(4, "little") + b"0N."
    with pytest.raises(pickle.UnpicklingError):
        item_header(data)


@pytest.mark.parametrize("hostile", [
    "b'\\x80\\x02}N' + b'\\x85' * 1_000_000 + b'Ns.'",  # a dict key nested a million deep
    "b'\\x80\\x02(N\\x85\\x85K\\x01d.'",  # DICT with a tuple key
    "b'\\x80\\x02\\x8f(N\\x85\\x90.'",  # a set of tuples
])
def test_data_pkl_hashing_a_tuple_is_refused_not_a_crash(hostile):
    # hash() of a tuple nested a million deep recursed in C until the process died (SIGSEGV); a plain
    # tensor's data.pkl hashes no tuple, so any tuple key is refused before it is hashed.
    code = ("import pickle\nfrom ckptverify.safeparse.torchsave import item_header\n"
            f"data = {hostile}\n"
            "try:\n    item_header(data)\nexcept pickle.UnpicklingError as exc:\n    print('refused:', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: data.pkl uses a tuple as a dict key or set member" in proc.stdout


def _g(module: bytes, name: bytes) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"


@pytest.mark.parametrize("body, refusal", [
    (_g(b"collections", b"OrderedDict") + b"]\x85R", "collections.OrderedDict called with arguments"),
    (_g(b"_codecs", b"encode") + b"\x8c\x01a\x8c\x04utf8\x86R", "_codecs.encode outside the bytes-in-protocol-2"),
])
def test_scan_pickle_refuses_what_torch_save_never_writes(body, refusal, monkeypatch):
    from ckptverify.errors import BadPickle
    from ckptverify.safeparse import torchsave

    data = b"\x80\x04" + body + b"."
    with pytest.raises(BadPickle, match=refusal):
        torchsave.scan_pickle(data)
    monkeypatch.setattr(torchsave, "MAX_PICKLE_BYTES", len(data) - 1)
    with pytest.raises(BadPickle, match="more than this tool reads"):
        torchsave.scan_pickle(data)


def test_a_storage_type_as_a_value_is_named_by_its_dtype():
    from ckptverify.safeparse.torchsave import leaf_values, scan_pickle

    scan = scan_pickle(b"\x80\x04" + _g(b"torch", b"FloatStorage") + b".")
    assert leaf_values(scan.root) == {"<root>": "storage-type:float32"}


@pytest.mark.parametrize("old, new, refusal", [
    (b"archive/data/1", b"archive/data/0", "'archive/data/0' appears twice"),
    (b"archive/version", b"archivX/version", "do not share one top-level folder"),
])
def test_renamed_records_are_refused(old, new, refusal):
    blob = _saved({"a": torch.ones(2), "b": torch.zeros(3)})
    assert blob.count(old) == 2  # its local header and its central directory entry
    renamed = blob.replace(old, new)
    with pytest.raises(ArchiveError, match=refusal):
        parse_archive(_reader(renamed), len(renamed))


# A torch.save archive of 4 GiB or more stores sizes and offsets as 0xFFFFFFFF in its central directory, the real
# values in a zip64 extra field, and may end a record with a 24-byte data descriptor. Such an archive is rebuilt
# here from a small one: same records, the large-archive encoding.
_FULL = 0xFFFFFFFF


def _split(blob: bytes) -> tuple[bytes, list[bytes]]:
    """The records before the central directory and its entries, each as stored."""
    n, cd_size, cd_offset = struct.unpack_from("<QQQ", blob, blob.rindex(b"PK\x06\x06") + 32)
    entries, at = [], cd_offset
    for _ in range(n):
        nlen, xlen, clen = struct.unpack_from("<HHH", blob, at + 28)
        entries.append(blob[at:at + 46 + nlen + xlen + clen])
        at += len(entries[-1])
    assert at == cd_offset + cd_size
    return blob[:cd_offset], entries


def _join(body: bytes, entries: list[bytes]) -> bytes:
    """An archive of ``body`` and ``entries`` with end records as torch writes them."""
    cd = b"".join(entries)
    n, z64_at = len(entries), len(body) + len(cd)
    return (body + cd + struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 798, 45, 0, 0, n, n, len(cd), len(body))
            + struct.pack("<4sIQI", b"PK\x06\x07", 0, z64_at, 1)
            + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(cd), len(body), 0))


def _zip64_entry(entry: bytes, *values: int, fields: tuple[str, ...] = ("usize", "csize", "offset"),
                 tag: int = 0x0001) -> bytes:
    """``entry`` with ``fields`` set to 0xFFFFFFFF and a zip64 extra field holding ``values`` (the entry's own
    values of those fields by default)."""
    at = {"csize": 20, "usize": 24, "offset": 42}
    out = bytearray(entry)
    own = []
    for name in ("usize", "csize", "offset"):  # the order of the zip64 extra field
        if name in fields:
            own.append(struct.unpack_from("<I", entry, at[name])[0])
            struct.pack_into("<I", out, at[name], _FULL)
    body = struct.pack(f"<{len(values or own)}Q", *(values or own))
    nlen = struct.unpack_from("<H", entry, 28)[0]
    struct.pack_into("<H", out, 30, len(body) + 4)
    return bytes(out[:46 + nlen]) + struct.pack("<HH", tag, len(body)) + body


def _records(blob: bytes) -> list[tuple[str, int, int, bytes]]:
    archive = parse_archive(_reader(blob), len(blob))
    return [(r.name, r.size, r.crc, blob[r.data_offset:r.data_end]) for r in archive.records]


def test_zip64_sizes_and_offsets_in_the_central_directory_are_read():
    blob = _saved({"a": torch.ones(2), "b": torch.zeros(3)})
    body, entries = _split(blob)
    assert _join(body, entries) == blob
    big = _join(body, [_zip64_entry(e) for e in entries])
    assert _records(big) == _records(blob)
    # Only the fields that overflow are in the extra field (here the offset alone), in the zip64 order.
    offsets = _join(body, [_zip64_entry(e, fields=("offset",)) for e in entries])
    assert _records(offsets) == _records(blob)
    zf = zipfile.ZipFile(io.BytesIO(big))
    assert [(n, len(d), zlib.crc32(d), d) for n, _, _, d in _records(big)] == [
        (i.filename, i.file_size, i.CRC, zf.read(i)) for i in zf.infolist()]


def test_a_zip64_data_descriptor_is_read():
    blob = _saved({"a": torch.ones(2), "b": torch.zeros(3)})
    body, entries = _split(blob)
    first = parse_archive(_reader(blob), len(blob)).records[0]
    at = first.data_end
    crc, size, size2 = struct.unpack_from("<4xIII", body, at)
    longer = body[:at] + struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size2) + body[at + 16:]
    moved = [e[:42] + struct.pack("<I", struct.unpack_from("<I", e, 42)[0] + 8) + e[46:]
             if struct.unpack_from("<I", e, 42)[0] > at else e for e in entries]
    big = _join(longer, moved)
    assert _records(big) == _records(blob)
    assert parse_archive(_reader(big), len(big)).records[1].header_offset == at + 24
    # A 24-byte descriptor whose size is not the record's is refused, as a 16-byte one is.
    wrong = body[:at] + struct.pack("<4sIQQ", b"PK\x07\x08", crc, size, size2 + 1) + body[at + 16:]
    bad = _join(wrong, moved)
    with pytest.raises(ArchiveError, match=f"data descriptor of '{first.name}' disagrees with the central directory"):
        parse_archive(_reader(bad), len(bad))


def _extra(entry: bytes, extra: bytes) -> bytes:
    """``entry`` with its extra field replaced by ``extra``."""
    nlen = struct.unpack_from("<H", entry, 28)[0]
    return entry[:30] + struct.pack("<H", len(extra)) + entry[32:46 + nlen] + extra


def _size(entry: bytes) -> int:
    return struct.unpack_from("<I", entry, 24)[0]


@pytest.mark.parametrize("edit, refusal", [
    # Three fields overflow, the extra field holds two values.
    (lambda e: _zip64_entry(e, _size(e), _size(e)), "zip64 extra field is too short"),
    # The zip64 extra field says 24 bytes follow; the entry's extra field ends after 16: too short for the three
    # values it must hold, and malformed where it need hold none.
    (lambda e: _extra(_zip64_entry(e), _zip64_entry(e)[-28:-8]), "zip64 extra field is too short"),
    (lambda e: _extra(e, _zip64_entry(e)[-28:-8]), "central directory extra field is malformed"),
    # The stored and uncompressed sizes disagree.
    (lambda e: _zip64_entry(e, _size(e), _size(e) + 1, fields=("usize", "csize")),
     "is compressed or uses flags torch never writes"),
    # The sizes agree with each other, not with the record's data descriptor.
    (lambda e: _zip64_entry(e, _size(e) + 1, _size(e) + 1, fields=("usize", "csize")),
     "data descriptor of .* disagrees with the central directory"),
    (lambda e: _zip64_entry(e, tag=0x5455), "central directory extra field 0x5455 is not one torch writes"),
    # Bytes after the last extra field.
    (lambda e: _extra(e, _zip64_entry(e, fields=())[-4:] + b"\0\0"), "central directory extra field is malformed"),
], ids=["too-few-values", "cut-short", "cut-short-unused", "sizes-disagree", "descriptor-disagrees", "other-tag",
        "trailing-bytes"])
def test_malformed_zip64_extra_fields_are_refused(edit, refusal):
    body, entries = _split(_saved({"a": torch.ones(2)}))
    bad = _join(body, [edit(entries[0]), *entries[1:]])
    with pytest.raises(ArchiveError, match=refusal):
        parse_archive(_reader(bad), len(bad))
