"""The commit protocol of a ckptverify save: an exclusive, crash-released lock and an in-progress marker.

A save into a directory that already holds a checkpoint rewrites its shards in place. Killed halfway, it
would leave the old ``.metadata`` beside a mixture of old and new shards, and every item would still be a
well-formed archive with a matching CRC. So the coordinator rank, before any rank writes a byte:

1. creates :data:`MARKER_FILE` and takes an exclusive ``flock`` on it (non-blocking: a second save into the
   same directory fails at once with :class:`~ckptverify.errors.SaveFailedError`); the lock belongs to the
   open file, so the kernel drops it when the saving process dies, and a crashed save never blocks the next;
2. writes who is saving into the marker (save id, pid, host, start time) and ``fsync``\\ s it and the
   directory;
3. removes the manifest and every DCP metadata file (``.metadata``, ``__N.metadata``) of the earlier save,
   so neither ckptverify nor plain ``dcp.load`` can read the directory as a checkpoint until this save
   commits.

DCP then writes the shards on every rank, gathers the results and writes ``.metadata``; the coordinator
writes the manifest (atomically) — **the commit** — and only then removes the marker and drops the lock.

Any crash therefore leaves either the marker (the save did not commit: ``verify`` and ``load`` refuse the
directory, see :mod:`ckptverify.checks.commit`) or a manifest with no marker (the whole save committed).
No torch import here: ``verify`` reads the marker too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ckptverify.errors import SaveFailedError
from ckptverify.ownfiles.names import MANIFEST_TEMP_PREFIX, SAVE_MARKER
from ckptverify.safeparse import paths, safejson

__all__ = ["MARKER_FILE", "MARKER_MAX_BYTES", "SaveLock", "begin_save", "read_marker"]

#: The in-progress marker (and lock file) of a save that has not committed.
MARKER_FILE = SAVE_MARKER
#: The most of the marker that is ever read (it holds a few short fields).
MARKER_MAX_BYTES = 4096
#: DCP metadata files an earlier save may have left: ``.metadata``, per-rank ``__N.metadata``, and the
#: temporary files of a metadata or manifest write that was killed.
_METADATA_NAME = re.compile(r"^(?:(?:__\d+)?\.metadata(?:\.tmp)?|" + re.escape(MANIFEST_TEMP_PREFIX) + r".*)$")


def _fsync_dir(root: str) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SaveLock:
    """The coordinator's hold on a directory while it saves into it. Not picklable (it owns a descriptor)."""

    root: str
    fd: int | None
    save_id: str

    def commit(self) -> None:
        """The save committed (its manifest is in place): remove the marker, then drop the lock."""
        if self.fd is None:
            raise RuntimeError("this save lock was already released")
        try:
            os.unlink(os.path.join(self.root, MARKER_FILE))
            _fsync_dir(self.root)
        finally:
            self.release()

    def release(self) -> None:
        """Drop the lock and leave the marker: the directory stays marked as holding no committed save."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    @property
    def held(self) -> bool:
        return self.fd is not None

    def __del__(self) -> None:
        # A writer whose save failed and that nobody releases (a checkpoint process of async_save, a
        # HashingFileSystemWriter given to dcp.save directly) lets go of the directory when it is collected.
        with contextlib.suppress(Exception):
            self.release()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a SaveLock cannot be pickled: its lock lives in the process that took it")


def _holder(fd: int) -> str:
    try:
        data = os.pread(fd, MARKER_MAX_BYTES, 0)
    except OSError:
        return "another process"
    info = _parse_marker(data)
    return describe_marker(info) if info else "another process"


def begin_save(root: str, save_id: str) -> SaveLock:
    """Lock ``root`` for one save and mark it as not committed; see the module docstring.

    Raises :class:`~ckptverify.errors.SaveFailedError` when another save holds the directory, and
    ``OSError`` when the marker cannot be created (e.g. something that is not a regular file sits at its
    name).
    """
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, MARKER_FILE)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(100):
        fd = os.open(path, flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} exists and is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SaveFailedError(
                    f"another save into {root} is in progress ({_holder(fd)}); refusing to write beside it"
                ) from None
            # A save that committed between our open() and flock() unlinked the file we locked: a lock on
            # a file no longer at `path` guards nothing, so start again on the file that is there now.
            mine = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        break
    else:  # pragma: no cover - needs 100 commits racing this one
        raise SaveFailedError(f"could not lock {root}: other saves keep committing into it")
    import socket  # here: only a save names its host, and verify should not pay the import at start-up

    try:
        record = {"save_id": save_id, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.now(UTC).isoformat(timespec="seconds")}
        data = json.dumps(record).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        _fsync_dir(root)
    except BaseException:
        os.close(fd)
        raise
    return SaveLock(root, fd, save_id)


def invalidate_previous(root: str, manifest_file: str) -> list[str]:
    """Remove the manifest and every DCP metadata file from ``root`` (the earlier save's commit records,
    and temporary files of killed ones), so the directory reads as no checkpoint until the save under way
    commits. Returns the names removed."""
    removed = []
    for name in sorted(os.listdir(root)):
        if name == manifest_file or _METADATA_NAME.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name))
                removed.append(name)
    if removed:
        _fsync_dir(root)
    return removed


def _parse_marker(data: bytes) -> dict[str, Any] | None:
    try:
        info = safejson.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return info if isinstance(info, dict) else None


def describe_marker(info: dict[str, Any]) -> str:
    """One line naming the save a marker belongs to (its fields may be anything: they are only shown)."""
    parts = []
    for key in ("save_id", "pid", "host", "started"):
        value = info.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            parts.append(f"{key} {str(value)[:80]}")
    return ", ".join(parts) if parts else "an unknown save"


def read_marker(root: str) -> dict[str, Any] | None:
    """The marker's fields if ``root`` holds a marker (``{}`` when it is unreadable or not a regular file),
    else ``None``. Never follows a link, never blocks, reads at most :data:`MARKER_MAX_BYTES`."""
    path = os.path.join(root, MARKER_FILE)
    if not paths.lexists(path):
        return None
    if paths.is_url(path):
        return _read_remote_marker(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        return _parse_marker(os.pread(fd, MARKER_MAX_BYTES, 0)) or {}
    except OSError:
        return {}
    finally:
        os.close(fd)


def _read_remote_marker(url: str) -> dict[str, Any]:
    """:func:`read_marker` for an object (no links, nothing that blocks): its first bytes, parsed."""
    from ckptverify.safeparse.readers import ReadOnlyFile

    try:
        with ReadOnlyFile(url) as f:
            return _parse_marker(f.pread(0, MARKER_MAX_BYTES)) or {}
    except OSError:
        return {}
