"""Change notification for a run directory (Linux ``inotify``), so ``watch`` acts as soon as a save lands.

:class:`DirectoryNotifier` watches a run directory and each directory directly under it (the checkpoints), and
:meth:`~DirectoryNotifier.wait` returns as soon as something was created, written, moved or deleted there,
or when its timeout passes. It is a wake-up call, never the source of truth: the watcher still lists the
directory on every pass and still waits at most its polling interval, so an event that is lost (a queue
overflow, a network file system that sends none, a directory deeper than the watch) only delays a pass.
Where inotify is unavailable, :meth:`~DirectoryNotifier.open` returns ``None`` and the watcher polls.

Called through ``ctypes`` on the C library: no dependency, nothing compiled.
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

__all__ = ["DirectoryNotifier"]

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

    def __init__(self, libc: ctypes.CDLL, fd: int, root: str) -> None:
        self._libc = libc
        self._fd = fd
        self._root = root
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
    def open(cls, root: str | os.PathLike[str]) -> DirectoryNotifier | None:
        """A notifier for ``root``, or ``None`` where inotify is not available (the caller polls)."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            _log.debug("inotify_init1 failed: %s", os.strerror(ctypes.get_errno()))
            return None
        notifier = cls(libc, fd, os.fspath(root))
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
        """Block until something changed or ``timeout`` seconds passed; ``True`` when woken by a change."""
        if self._fd < 0:
            time.sleep(max(0.0, timeout))
            return False
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not ready:
            return False
        time.sleep(GATHER_SECONDS)
        self._drain()
        return True

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                return
            if not data:
                return
            pos = 0
            while pos + _HEADER.size <= len(data):
                wd, mask, _cookie, length = _HEADER.unpack_from(data, pos)
                name = data[pos + _HEADER.size : pos + _HEADER.size + length].split(b"\0", 1)[0]
                pos += _HEADER.size + length
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
