"""Verify's per-byte paths miss no byte: a flipped byte at every boundary of how they cut the bytes is found.

Verify reads each range in pieces (``readers.READ_BYTES`` per read into a reused buffer), splits large
records into segments hashed on all cores (``dcp_pipeline.SEGMENT_BYTES``, CRCs combined), and with a manifest
hashes block-aligned tasks (one digest per ``block_bytes``; a piece that is exactly one block takes a path of
its own). Here pieces, segments and blocks are made small, so one checkpoint of a MiB has many of each,
and a byte is flipped on each side of every boundary (of a piece, a segment, a block, counted from the record's
payload and from the item's start), at the first and last byte of the payload, and of the file.
"""

from __future__ import annotations

import os
import shutil
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit.adopt import fingerprint_checkpoint
from ckptverify.audit.verify import verify_checkpoint
from ckptverify.checks import content, dcp_pipeline
from ckptverify.ownfiles.manifest import MANIFEST_FILE
from ckptverify.safeparse import readers

KIB = 1 << 10
SEGMENT = 192 * KIB
#: (read piece, manifest block): a piece that is one block (each piece digested whole), a block of two
#: pieces, and pieces that straddle blocks.
CUTS = [(64 * KIB, 64 * KIB), (64 * KIB, 128 * KIB), (96 * KIB, 64 * KIB)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One DCP checkpoint (one file) whose tensor payload spans many pieces, segments and blocks; where that
    payload and its item lie in the file."""
    root = tmp_path_factory.mktemp("read-boundaries") / "ckpt"
    g = torch.Generator().manual_seed(21)
    # Above content.SMALL_ITEM_BYTES (1 MiB: read whole, CRCs from memory), so it takes the piecewise paths;
    # an odd length: the last piece, segment and block are partial.
    w = torch.randn(300_003, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": w, "b": torch.randn(7, generator=g)},
                 storage_writer=dcp.FileSystemWriter(str(root), single_file_per_rank=True, thread_count=1))
    payload = w.numpy().tobytes()
    assert len(payload) > content.SMALL_ITEM_BYTES
    md = dcp.FileSystemReader(str(root)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    data = (root / info.relative_path).read_bytes()
    start = data.index(payload)
    assert data.count(payload[:4096]) == 1
    return {"root": root, "file": info.relative_path, "item": (info.offset, info.length),
            "payload": (start, len(payload)), "size": len(data)}


def _offsets(saved: dict, piece: int, block: int) -> list[int]:
    """Every byte on either side of a boundary of pieces, segments and blocks, counted from the payload's and
    from the item's first byte, inside the payload; its first and last byte; the file's first and last."""
    p0, plen = saved["payload"]
    i0, _ = saved["item"]
    out = {p0, p0 + plen - 1, 0, saved["size"] - 1}
    for base in (p0, i0):
        for step in (piece, SEGMENT, block):
            k = base + step
            while k < p0 + plen:
                if k > p0:
                    out.update((k - 1, k))
                k += step
    return sorted(out)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(("piece", "block"), CUTS)
@pytest.mark.parametrize("with_manifest", [False, True], ids=["crc", "manifest"])
def test_a_flipped_byte_at_every_boundary_is_found(saved: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   piece: int, block: int, with_manifest: bool) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved["root"], root)
    if with_manifest:
        report, manifest = fingerprint_checkpoint(str(root), block_bytes=block)
        assert report.passed and manifest is not None and (root / MANIFEST_FILE).exists()
    monkeypatch.setattr(readers, "READ_BYTES", piece)
    monkeypatch.setattr(dcp_pipeline, "SEGMENT_BYTES", SEGMENT)
    clean = verify_checkpoint(str(root), jobs=2)
    assert clean.passed, [f.message for f in clean.findings if f.severity.value == "error"]
    assert clean.stats["manifest"] is with_manifest
    target = root / saved["file"]
    p0, plen = saved["payload"]
    missed = []
    for at in _offsets(saved, piece, block):
        _flip(target, at)
        try:
            report = verify_checkpoint(str(root), jobs=2)
        finally:
            _flip(target, at)
        errors = {f.check for f in report.findings if f.severity.value == "error"}
        if report.passed or not errors:
            missed.append(at)
        elif p0 <= at < p0 + plen:  # a payload byte: found by its checksum, and only by that
            assert errors <= {"zip-crc", "manifest-digest", "zip-structure"}, (at, errors)
            assert errors & {"zip-crc", "manifest-digest"}, (at, errors)
    assert not missed, f"flipped bytes at {missed} passed verification"
    assert verify_checkpoint(str(root), jobs=2).passed  # every flip undone: the same bytes pass again


def test_isal_and_zlib_crc32_agree_and_combine_alike() -> None:
    """Verify's CRC-32 (ISA-L) gives zlib's values, piecewise and combined, on every length class."""
    from isal import isal_zlib

    data = os.urandom(3 * (1 << 20) + 7)
    for n in (0, 1, 15, 16, 63, 64, 65, 4095, 4096, 5 * KIB + 1, 1 << 20, len(data)):
        assert isal_zlib.crc32(data[:n]) == zlib.crc32(data[:n])
        assert isal_zlib.crc32(data[n:], 12345) == zlib.crc32(data[n:], 12345)
    for cut in (1, 4096, 1 << 20, len(data) - 1):
        a, b = zlib.crc32(data[:cut]), zlib.crc32(data[cut:])
        assert readers.crc32_combine(a, b, len(data) - cut) == zlib.crc32(data)


def test_a_file_crc_through_any_piece_size_is_zlibs(saved: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    path = saved["root"] / saved["file"]
    want = zlib.crc32(path.read_bytes())
    for piece in (4 * KIB, 96 * KIB, 1 << 20):
        monkeypatch.setattr(readers, "READ_BYTES", piece)
        with readers.ReadOnlyFile(str(path)) as f:
            assert f.crc32(0, f.size) == want
