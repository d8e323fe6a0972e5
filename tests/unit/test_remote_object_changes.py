"""A remote object read through fsspec's in-memory file system: what is refused at open, and how a change of the
object after it was opened is told (no ETag there: size and time are its signature)."""

from __future__ import annotations

import time
import uuid

import fsspec
import pytest

from ckptverify.errors import FileChangedError, UnsafeFileError, UsageError
from ckptverify.safeparse import remote


@pytest.fixture
def url() -> str:
    return f"memory://remote-changes/{uuid.uuid4().hex[:8]}"


def test_a_prefix_is_not_opened_as_a_file_nor_a_file_listed_as_a_folder(url: str) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{url}/obj", b"x")
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        remote.RemoteFile(url)
    with pytest.raises(NotADirectoryError):
        remote.scandir(f"{url}/obj")


def test_read_small_refuses_past_its_limit_and_reads_an_empty_object(url: str) -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{url}/big", b"0123456789")
    fs.pipe_file(f"{url}/empty", b"")
    with pytest.raises(UnsafeFileError, match="more than the 4 this tool reads"):
        remote.read_small(f"{url}/big", 4)
    assert remote.read_small(f"{url}/empty", 4) == b""


def test_an_object_gone_or_cut_short_after_opening_is_a_change(url: str) -> None:
    fs = fsspec.filesystem("memory")
    name = f"{url}/obj"
    fs.pipe_file(name, b"0123456789")
    with remote.RemoteFile(name) as f:
        fs.pipe_file(name, b"01234")
        with pytest.raises(FileChangedError, match="ends at byte 5 now but was 10 bytes"):
            f.pread(0, 10)
        time.sleep(0.01)  # the end check lists afresh only after the last read
        assert "bytes modified at" in f.changed()
    time.sleep(0.01)
    with remote.RemoteFile(name) as f:
        fs.rm_file(name)
        with pytest.raises(FileChangedError, match="the object is gone"):
            f.pread(0, 5)
        assert f.changed() == "its name no longer opens it (no such object)"


def test_storage_options_that_are_not_json_are_refused_unechoed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(remote.OPTIONS_ENV, "{not json secret")
    with pytest.raises(UsageError, match="must hold a JSON object") as caught:
        remote.storage_options("memory://x")
    assert "secret" not in str(caught.value)


def test_listings_kept_for_end_checks_are_bounded_oldest_dropped_first(url: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived process checks objects under many prefixes: past the bound the oldest listing is dropped, and an
    end check under its prefix lists it afresh (one listing per prefix while kept)."""
    monkeypatch.setattr(remote, "_LISTINGS_KEPT", 2)
    monkeypatch.setattr(remote, "_listings", {})
    fs, _ = remote.filesystem(url)
    listed: list[str] = []
    real_ls = fs.ls

    def ls(path: str, detail: bool = True, **kw: object) -> object:
        listed.append(path.rsplit("/", 1)[-1])
        return real_ls(path, detail, **kw)

    monkeypatch.setattr(fs, "ls", ls)
    files = []
    for n in range(3):
        fs.pipe_file(f"{url}/p{n}/obj", b"0123456789")
        files.append(remote.RemoteFile(f"{url}/p{n}/obj"))
    try:
        for f in files:
            assert f.pread(0, 10) == b"0123456789"
        for n in (0, 1, 0, 2, 1, 0):
            assert files[n].changed() is None
            assert len(remote._listings) <= 2
        # p0 listed, p1 listed, p0 kept, p2 listed (p0 dropped), p1 kept, p0 listed afresh.
        assert listed == ["p0", "p1", "p2", "p0"]
    finally:
        for f in files:
            f.close()
