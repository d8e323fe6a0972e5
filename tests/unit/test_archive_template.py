"""Small items are checked from memory against a template: the same archives, CRCs and findings as the full parse.

``ArchiveTemplate.match`` stands in for ``parse_archive`` on items of the same length as one parsed before;
``checks.content.plan_file`` reads small items many at a time and computes their CRCs while planning. These
tests hold both to the general path: whenever a template matches, ``parse_archive`` gives the same archive;
every single-byte change of an item is either refused by the template or gives what the full parse gives;
and ``verify`` reports the same findings for damaged checkpoints whichever path checks their items.
"""

from __future__ import annotations

import io
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.checks import content
from ckptverify.errors import ArchiveError
from ckptverify.safeparse.readers import crc32
from ckptverify.safeparse.zipwalk import ArchiveTemplate, parse_archive, parse_item


def _saved(value: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _full(blob: bytes):
    """What the general path makes of an item: (archive, CRC per record) or the error's range."""
    try:
        archive = parse_archive(lambda off, n: blob[off:off + max(0, n)] if off >= 0 else b"", len(blob))
    except ArchiveError as exc:
        return ("error", exc.start, exc.end)
    return archive, [crc32(blob[r.data_offset:r.data_end]) for r in archive.records]


def _template(blob: bytes) -> ArchiveTemplate:
    parsed = parse_item(blob, 0, len(blob))
    crcs = [crc32(blob[r.data_offset:r.data_end]) for r in parsed.archive.records]
    return ArchiveTemplate(blob, parsed, crcs)


def _by_template(template: ArchiveTemplate, blob: bytes):
    matched = template.match(blob, 0)
    if matched is None:
        return None
    archive, known = matched
    return archive, [c if c is not None else crc32(blob[r.data_offset:r.data_end])
                     for c, r in zip(known, archive.records, strict=True)]


def test_items_of_one_shape_match_the_template_as_the_full_parse_reads_them():
    blobs = [_saved(torch.full((4, 3), float(i))) for i in range(20)]
    template = _template(blobs[0])
    for blob in blobs:
        assert len(blob) == len(blobs[0])
        assert _by_template(template, blob) == _full(blob)
    # The serialization id and the values vary; the rest (data.pkl, version records) was learned constant.
    varying = {template.archive.records[r].name.rsplit("/", 1)[-1] for r in template.varying}
    assert varying == {"0", "serialization_id"}


def test_every_flipped_byte_is_refused_or_read_as_the_full_parse_reads_it():
    base = _saved(torch.arange(6, dtype=torch.float32))
    template = _template(base)
    assert _by_template(template, _saved(torch.zeros(6))) == _full(_saved(torch.zeros(6)))  # learn variation
    refused = 0
    for at in range(len(base)):
        for bit in (0x01, 0x80):
            blob = bytearray(base)
            blob[at] ^= bit
            got = _by_template(template, bytes(blob))
            if got is None:
                refused += 1
            else:
                assert got == _full(bytes(blob)), at
    assert refused > len(base)  # everything outside payloads and CRC fields


@settings(max_examples=500, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, width=32), min_size=5, max_size=5),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=6))
def test_multi_byte_changes_are_refused_or_read_as_the_full_parse_reads_them(values, flips):
    template = _template(_saved(torch.zeros(5)))
    blob = bytearray(_saved(torch.tensor(values)))
    for at, xor in flips:
        blob[at % len(blob)] ^= xor
    got = _by_template(template, bytes(blob))
    if got is not None:
        assert got == _full(bytes(blob))


def test_copies_of_a_crc_that_disagree_are_left_to_the_full_parse():
    blob = _saved(torch.ones(3))
    template = _template(blob)
    parsed = parse_item(blob, 0, len(blob))
    name = parsed.archive.records[0].name
    fields = parsed.crc_fields[name]
    assert len(fields) >= 2  # the central directory entry and the data descriptor
    template._state = (frozenset({0}), template._segments(frozenset({0})))
    bad = bytearray(blob)
    bad[fields[-1]] ^= 1
    assert template.match(bytes(bad), 0) is None
    assert _full(bytes(bad))[0] == "error"


# verify: the in-memory path and the general path report the same findings.


def _tiny_checkpoint(path: Path) -> Path:
    state = {f"layer.{i}.w": torch.randn(3 + i % 2, 2) for i in range(40)}
    state["step"] = 7
    state["names"] = ["a", "b"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), thread_count=2))
    return path


def _findings(path: Path) -> list[dict]:
    report = verify_checkpoint(path, jobs=1)
    return [f.to_dict() for f in report.findings if f.check != "manifest-absent"], report.stats["bytes_hashed"]


def _both_paths(path: Path, monkeypatch) -> tuple:
    in_memory = _findings(path)
    with monkeypatch.context() as m:
        m.setattr(content, "SMALL_ITEM_BYTES", 0)  # every item through parse_archive and segment hashing
        general = _findings(path)
    return in_memory, general


def test_clean_checkpoint_passes_the_same_on_both_paths(tmp_path, monkeypatch):
    path = _tiny_checkpoint(tmp_path / "ckpt")
    in_memory, general = _both_paths(path, monkeypatch)
    assert in_memory == general
    assert in_memory[0] == [] and in_memory[1] > 0


def test_damaged_items_give_the_same_findings_on_both_paths(tmp_path, monkeypatch):
    src = _tiny_checkpoint(tmp_path / "src")
    files = sorted(p for p in src.iterdir() if p.suffix == ".distcp")
    rng = random.Random(5)
    for case in range(40):
        dst = tmp_path / f"case{case}"
        dst.mkdir()
        for p in src.iterdir():
            (dst / p.name).write_bytes(p.read_bytes())
        victim = dst / rng.choice(files).name
        blob = bytearray(victim.read_bytes())
        for _ in range(rng.choice((1, 1, 2, 5))):
            blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(blob))
        in_memory, general = _both_paths(dst, monkeypatch)
        assert in_memory == general, case
        assert in_memory[0], case  # every flip is caught


def test_windows_read_each_small_item_once(tmp_path, monkeypatch):
    path = _tiny_checkpoint(tmp_path / "ckpt")
    reads: list[int] = []
    real = content.ReadOnlyFile.pread

    def counting(self, offset: int, n: int) -> bytes:
        reads.append(n)
        return real(self, offset, n)

    monkeypatch.setattr(content.ReadOnlyFile, "pread", counting)
    report = verify_checkpoint(path, jobs=1)
    assert report.passed and report.stats["files"] == 2
    assert len(reads) <= 4  # per file: one read for the items' first bytes, one for the items; none per item


@pytest.mark.parametrize("length", [10, 22, 97, 98, 99, 200])
def test_short_or_odd_items_are_refused_by_both(length):
    blob = _saved(torch.ones(2))[:length]
    template = _template(_saved(torch.ones(2)))
    assert template.match(blob + bytes(max(0, len(template.data) - len(blob))), 0) in (None, _by_template(
        template, blob + bytes(max(0, len(template.data) - len(blob)))))
    assert _full(blob)[0] == "error"
