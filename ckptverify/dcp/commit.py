"""The commit protocol of a ckptverify save: an exclusive, crash-released lock and an in-progress marker.

A save rewriting a checkpoint in place and killed halfway would leave the old ``.metadata`` over mixed shards,
every item still well formed. So before any rank writes, the coordinator creates :data:`SAVE_MARKER` and takes
a non-blocking ``flock`` on it (a concurrent save fails at once; the kernel drops it if the process dies),
records who is saving (fsynced with the directory), and removes the earlier manifest and metadata files so the
directory reads as no checkpoint. After ``.metadata``, the manifest is written atomically (the commit), then the
marker removed. A crash leaves either the marker (``verify``/``load`` refuse) or a committed save. No torch here.
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

__all__ = ["MARKER_MAX_BYTES", "SaveLock", "begin_save", "read_marker"]

#: The most of the marker that is ever read (it holds a few short fields).
MARKER_MAX_BYTES = 4096
#: Metadata files an earlier save may have left, and temporaries of killed metadata or manifest writes.
_METADATA_NAME = re.compile(r"^(?:(?:__\d+)?\.metadata(?:\.tmp)?|" + re.escape(MANIFEST_TEMP_PREFIX) + r".*)$")


def _fsync_dir(root: str) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class SaveLock:
    """The coordinator's hold on a directory while it saves into it: a descriptor of this process (a pickled writer
    leaves its lock behind)."""

    root: str
    fd: int | None
    save_id: str

    def commit(self) -> None:
        """The save committed (its manifest is in place): remove the marker, then drop the lock. Only on a held lock."""
        try:
            os.unlink(os.path.join(self.root, SAVE_MARKER))
            _fsync_dir(self.root)
        finally:
            self.release()

    def release(self) -> None:
        """Drop the lock and leave the marker: the directory stays marked as holding no committed save."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    def __del__(self) -> None:
        # A failed writer nobody releases lets go of the directory when collected.
        with contextlib.suppress(Exception):
            self.release()


def _holder(fd: int) -> str:
    try:
        info = _parse_marker(os.pread(fd, MARKER_MAX_BYTES, 0))
    except OSError:
        info = None
    return describe_marker(info) if info else "another process"


def begin_save(root: str, save_id: str) -> SaveLock:
    """Lock ``root`` for one save and mark it uncommitted (see the module docstring). Raises
    :class:`~ckptverify.errors.SaveFailedError` if another save holds it, ``OSError`` if the marker cannot be created.
    """
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, SAVE_MARKER)
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
            # A save that committed between open() and flock() unlinked our file: a lock on it guards nothing; retry.
            mine = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                os.close(fd)
                continue
            import socket  # here: only a save names its host, and verify should not pay the import at start-up

            record = {"save_id": save_id, "pid": os.getpid(), "host": socket.gethostname(),
                      "started": datetime.now(UTC).isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
            _fsync_dir(root)
            return SaveLock(root, fd, save_id)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
    raise SaveFailedError(f"could not lock {root}: other saves keep committing into it")  # pragma: no cover - a race


def invalidate_previous(root: str, manifest_file: str) -> None:
    """Remove the manifest and every DCP metadata file (and killed writes' temporaries) from ``root`` so it reads as
    no checkpoint until this save commits."""
    removed = False
    for name in sorted(os.listdir(root)):
        if name == manifest_file or _METADATA_NAME.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, name))
                removed = True
    if removed:
        _fsync_dir(root)


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
    """The marker's fields if ``root`` holds one (``{}`` if unreadable or not regular), else ``None``. Never follows a
    link, never blocks, reads at most :data:`MARKER_MAX_BYTES`."""
    path = os.path.join(root, SAVE_MARKER)
    if not paths.lexists(path):
        return None
    if paths.is_url(path):  # an object: no links, nothing that blocks
        from ckptverify.safeparse.readers import ReadOnlyFile

        try:
            with ReadOnlyFile(path) as f:
                return _parse_marker(f.pread(0, MARKER_MAX_BYTES)) or {}
        except OSError:
            return {}
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
