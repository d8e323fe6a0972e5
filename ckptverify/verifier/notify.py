"""Change notification for a run directory (Linux ``inotify`` via ``ctypes``), so ``watch`` acts as a save lands.

:class:`DirectoryNotifier` watches the run directory and each directory directly under it. It is a wake-up call,
never the source of truth: the watcher still lists and polls, so a lost event only delays a pass; without
inotify, :meth:`~DirectoryNotifier.open` returns ``None``. ckptverify's own files (:func:`own_file`) and given
names wake nothing: otherwise the watcher's own writes would wake it endlessly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import select
import struct
import sys
import time
from collections.abc import Callable, Collection

from ckptverify.ownfiles.names import METRICS_TEMP_PREFIX, PARTS_PREFIX, STAMP_FILE, STAMP_TEMP_PREFIX, VERIFYING_LOCK

__all__ = ["DirectoryNotifier", "own_file"]

_log = logging.getLogger(__name__)

IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_Q_OVERFLOW = 0x00004000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = getattr(os, "O_CLOEXEC", 0o2000000)
_MASK = (IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF
         | IN_ONLYDIR | IN_DONT_FOLLOW)
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event), then len bytes of name
#: At most this many directories are watched (each costs a kernel watch; the rest are polled).
MAX_WATCHES = 4096
#: After the first event, how long to let a burst of events (a save writing many files) gather.
GATHER_SECONDS = 0.2


def own_file(name: str) -> bool:
    """Whether ``name`` is a file ckptverify writes while verifying (stamp, verifying lock, temporaries, part verdict).
    """
    return (name in (STAMP_FILE, VERIFYING_LOCK) or name.endswith(f".{STAMP_FILE}")
            or name.startswith((STAMP_TEMP_PREFIX, METRICS_TEMP_PREFIX, PARTS_PREFIX)))


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.inotify_init1  # noqa: B018 - probe: missing on C libraries without inotify
        libc.inotify_add_watch  # noqa: B018
    except (OSError, AttributeError):
        return None
    libc.inotify_init1.argtypes = [ctypes.c_int]
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    return libc


class DirectoryNotifier:
    """Wake-ups for changes in ``root`` and the directories directly under it (see the module docstring)."""

    def __init__(self, libc: ctypes.CDLL, fd: int, root: str, ignore: Callable[[str], bool] = own_file) -> None:
        self._libc = libc
        self._fd = fd
        self._root = root
        self._ignore = ignore
        self._watched: dict[int, str] = {}
        self._add(root)
        try:
            with os.scandir(root) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        self._add(entry.path)
        except OSError:
            pass

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, ignore_names: Collection[str] = ()) -> DirectoryNotifier | None:
        """A notifier for ``root``, or ``None`` without inotify. Changes to ``ignore_names`` or :func:`own_file` s wake
        nothing."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            _log.debug("inotify_init1 failed: %s", os.strerror(ctypes.get_errno()))
            return None
        names = frozenset(ignore_names)
        notifier = cls(libc, fd, os.fspath(root), ignore=lambda name: name in names or own_file(name))
        if not notifier._watched:  # not even the run directory itself: nothing to wait on
            notifier.close()
            return None
        return notifier

    def _add(self, path: str) -> None:
        if len(self._watched) >= MAX_WATCHES:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), _MASK)
        if wd >= 0:
            self._watched[wd] = path

    def wait(self, timeout: float) -> bool:
        """Block until a change or ``timeout``; ``True`` if woken by a change (ignored files never end the wait)."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            ready, _, _ = select.select([self._fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            time.sleep(GATHER_SECONDS)
            if self._drain():
                return True

    def _drain(self) -> bool:
        """Read every pending event; whether any of them was not about an ignored file."""
        relevant = False
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except OSError:  # BlockingIOError: nothing more to read
                return relevant
            if not data:
                return relevant
            pos = 0
            while pos + _HEADER.size <= len(data):
                wd, mask, _cookie, length = _HEADER.unpack_from(data, pos)
                name = data[pos + _HEADER.size : pos + _HEADER.size + length].split(b"\0", 1)[0]
                pos += _HEADER.size + length
                if not name or mask & IN_Q_OVERFLOW or not self._ignore(os.fsdecode(name)):
                    relevant = True
                if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO) and self._watched.get(wd) == self._root:
                    self._add(os.path.join(self._root, os.fsdecode(name)))  # a new checkpoint directory
                if mask & IN_DELETE_SELF:
                    self._watched.pop(wd, None)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirectoryNotifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
