"""Files are read through at most ``readers.MAX_OPEN`` descriptors at once, and reopening one is as safe as
keeping it open.

A checkpoint saved one file per item has as many files as items: holding them all open exhausted the
descriptor limit and verify reported clean files as missing. Now idle descriptors are closed (least
recently used first) and reopened through the same checks, and a file reopened must be the same, unchanged
file, or the read says the file changed.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptverify.audit.verify import verify_checkpoint
from ckptverify.errors import FileChangedError
from ckptverify.safeparse import readers
from ckptverify.safeparse.readers import ReadOnlyFile


@pytest.fixture
def few_descriptors(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(readers, "MAX_OPEN", 3)
    return 3


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_checkpoint_of_more_files_than_descriptors_verifies(tmp_path: Path, few_descriptors: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"w{i}": torch.full((3,), float(i)) for i in range(30)},
                 storage_writer=dcp.FileSystemWriter(str(path), single_file_per_rank=False))
    assert len(list(path.glob("*.distcp"))) == 30
    peak = 0
    real_pread = ReadOnlyFile.pread

    def watching(self: ReadOnlyFile, offset: int, n: int) -> bytes:
        nonlocal peak
        peak = max(peak, sum(1 for f in readers._DESCRIPTORS._open if f._fd is not None))
        return real_pread(self, offset, n)

    monkeypatch.setattr(ReadOnlyFile, "pread", watching)
    before = _open_fds()
    report = verify_checkpoint(path, jobs=2, deep=True)
    assert report.passed, [f.message for f in report.errors]
    assert report.stats["files"] == 30 and report.stats["items"] == 30
    assert 0 < peak <= few_descriptors + 2  # a few more only while reads in other threads hold theirs
    assert _open_fds() <= before


def test_a_file_changed_while_its_descriptor_was_closed_is_reported(tmp_path: Path, few_descriptors: int) -> None:
    paths = [tmp_path / f"f{i}" for i in range(5)]
    for p in paths:
        p.write_bytes(os.urandom(4096))
    files = [ReadOnlyFile(str(p)) for p in paths]
    try:
        assert files[0]._fd is None  # evicted by the later ones
        assert files[0].pread(0, 10) == paths[0].read_bytes()[:10]  # reopened: the same file
        files[1].pread(0, 1)
        files[2].pread(0, 1)
        files[3].pread(0, 1)  # files[0] evicted again
        assert files[0]._fd is None
        was = os.stat(paths[0])
        paths[0].write_bytes(os.urandom(4096))  # same size, new content and modification time
        # A later modification time whatever the file system's timestamp granularity (no waiting for the clock).
        os.utime(paths[0], ns=(was.st_atime_ns, was.st_mtime_ns + 1_000_000_000))
        with pytest.raises(FileChangedError):
            files[0].pread(0, 10)
        assert "modified" in (files[0].changed() or "")
        assert files[4].changed() is None
        os.unlink(paths[4])
        files[1].pread(0, 1)
        files[2].pread(0, 1)
        files[3].pread(0, 1)  # files[4] evicted
        assert files[4]._fd is None
        assert "no longer opens it" in (files[4].changed() or "")
        with pytest.raises(FileChangedError):
            files[4].pread(0, 1)
    finally:
        for f in files:
            f.close()
    assert not readers._DESCRIPTORS._open or all(f._fd is None for f in files)


def test_a_replaced_file_is_not_read_after_reopening(tmp_path: Path, few_descriptors: int) -> None:
    paths = [tmp_path / f"f{i}" for i in range(5)]
    for p in paths:
        p.write_bytes(b"a" * 100)
    files = [ReadOnlyFile(str(p)) for p in paths]
    try:
        spare = tmp_path / "spare"
        spare.write_bytes(b"a" * 100)
        os.utime(spare, ns=(os.stat(paths[0]).st_atime_ns, os.stat(paths[0]).st_mtime_ns))
        os.replace(spare, paths[0])  # same size, same modification time, another inode
        with pytest.raises(FileChangedError, match="replaced"):
            files[0].pread(0, 10)
    finally:
        for f in files:
            f.close()
