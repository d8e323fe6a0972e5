"""Opening and reading checkpoint files: read-only, never blocking, never outside the checkpoint, never by signal.

Everything under a checkpoint is hostile, file *types* included. A file is ``stat``-ed before opening and
opened only if regular (a FIFO blocks, ``/dev/zero`` never ends), with ``O_RDONLY|O_NONBLOCK|O_NOCTTY|O_CLOEXEC``,
then ``fstat``-checked (same inode). With a root it must resolve inside it (opened ``O_NOFOLLOW``; on Linux
``/proc/self/fd`` is checked after opening). Reads use ``os.preadv`` into a per-thread, cache-sized buffer, never
a mapping (a file truncated under a mapping kills the reader with ``SIGBUS``). A short read, or a changed
``fstat`` (:meth:`ReadOnlyFile.changed`), is :class:`~ckptverify.errors.FileChangedError`; refusals are
:class:`~ckptverify.errors.UnsafeFileError`. Both are ``OSError`` s, which checks turn into findings.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

# SIMD CRC-32 (ISA-L): identical values to zlib.crc32, about 3-4x faster.
from isal.isal_zlib import crc32, crc32_combine

from ckptverify.errors import FileChangedError, UnsafeFileError
from ckptverify.safeparse.fold import Folding
from ckptverify.safeparse.paths import is_url

__all__ = ["READ_BYTES", "ReadOnlyFile", "crc32", "crc32_combine", "file_kind", "is_inside", "open_regular", "pacing",
           "read_small_file"]

#: Bytes read per ``preadv`` into the per-thread buffer: a multiple of the page size that fits in L2 cache.
READ_BYTES = 1 << 20

_OPEN_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_BINARY", 0))
_local = threading.local()


def file_kind(mode: int) -> str:
    """A short name for the file type in ``mode`` (``"regular file"``, ``"FIFO"``, ...)."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link")):
        if test(mode):
            return name
    return "special file"


def is_inside(root: str, path: str, *, real_root: str | None = None) -> bool:
    """True if ``path`` resolved (symlinks, ``..``) lies inside ``root`` resolved (``real_root`` if given). For a
    URL: ``path`` names a key under ``root``'s prefix."""
    if is_url(path) or is_url(root):
        base = root.rstrip("/") + "/"
        return path.startswith(base) and ".." not in path[len(base):].split("/")
    try:
        _resolve_inside(root, path, real_root or os.path.realpath(root))
    except UnsafeFileError:
        return False
    return True


def _resolve_inside(root: str, path: str, real_root: str) -> tuple[str, os.stat_result | None]:
    """``path`` resolved (symlinks, ``..``) and, when one ``lstat`` told it, its ``lstat``; raises
    :class:`~ckptverify.errors.UnsafeFileError` unless it lies inside ``real_root`` (``root`` resolved). That one
    ``lstat`` suffices when ``path`` is ``root/NAME`` and that entry is no symbolic link: it saves a call per
    component per file."""
    head, sep, name = path.rpartition("/")
    if sep and root and head.rstrip("/") == root.rstrip("/") and name not in ("", ".", ".."):
        real = os.path.join(real_root, name)
        with suppress(OSError, ValueError):
            st = os.lstat(real)
            if not stat.S_ISLNK(st.st_mode):
                return real, st
    real = os.path.realpath(path)
    if real == real_root or not _under(real_root, real):
        raise UnsafeFileError(f"{path} resolves to {real}, outside the checkpoint directory {real_root}", path)
    return real, None


def _under(real_root: str, real: str) -> bool:
    """``os.path.commonpath([real_root, real]) == real_root`` for normalized absolute paths, by prefix first."""
    prefix = real_root if real_root.endswith("/") else real_root + "/"
    return real.startswith(prefix) or real == real_root or os.path.commonpath([real_root, real]) == real_root


def open_regular(path: str, *, root: str | None = None, real_root: str | None = None) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading iff it is a regular file (inside ``root`` when given); never blocks.

    Returns the descriptor (the caller closes it) and its ``fstat``. Raises :class:`~ckptverify.errors.UnsafeFileError`
    (not regular, or resolving outside ``root``) without opening, ``FileNotFoundError`` if missing. ``real_root``:
    ``root`` already resolved.
    """
    fd, st, _ = _open_regular(path, root, real_root)
    return fd, st


def _open_regular(path: str, root: str | None, real_root: str | None) -> tuple[int, os.stat_result, str]:
    """:func:`open_regular`, also returning the path opened (resolved, when ``root`` is given)."""
    target = path
    before = None
    if root is not None:
        real_root = real_root or os.path.realpath(root)
        target, before = _resolve_inside(root, path, real_root)  # before, when known: what the stat below gives
    if before is None:
        before = os.stat(target, follow_symlinks=root is None)
    if not stat.S_ISREG(before.st_mode):
        raise UnsafeFileError(f"{path} is a {file_kind(before.st_mode)}, not a regular file", path)
    # The resolved path holds no link to follow; O_NOFOLLOW makes a link swapped in meanwhile fail (ELOOP).
    fd = os.open(target, _OPEN_FLAGS | (getattr(os, "O_NOFOLLOW", 0) if root is not None else 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise FileChangedError(f"{path} was replaced while it was being opened", path)
        if root is not None:
            _check_descriptor_inside(fd, path, real_root)
    except BaseException:
        os.close(fd)
        raise
    return fd, st, target


def _check_descriptor_inside(fd: int, path: str, real_root: str) -> None:
    """Where ``/proc`` tells the opened file's path, it must be inside ``real_root`` (a directory may have been
    swapped for a link between resolving and opening)."""
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return  # no /proc: the resolved-path check before opening stands
    if not _under(real_root, opened):
        raise UnsafeFileError(f"{path} was opened at {opened}, outside the checkpoint directory {real_root}", path)


def read_small_file(path: str, limit: int, *, root: str | None = None) -> bytes:
    """The whole content of a small regular file, opened as :func:`open_regular` does.

    Raises :class:`~ckptverify.errors.UnsafeFileError` past ``limit`` bytes (checked before and while reading) and
    :class:`~ckptverify.errors.FileChangedError` if it changed while read. A URL goes to ``remote.read_small``.
    """
    if is_url(path):
        from ckptverify.safeparse.remote import read_small

        return read_small(path, limit)
    fd, st = open_regular(path, root=root)
    try:
        if st.st_size > limit:
            raise UnsafeFileError(f"{path} is {st.st_size} bytes, more than the {limit} this tool reads for it", path)
        parts: list[bytes] = []
        total = 0
        while True:
            part = os.pread(fd, min(READ_BYTES, limit + 1 - total), total)
            if not part:
                break
            parts.append(part)
            total += len(part)
            if total > limit:
                raise UnsafeFileError(f"{path} grew past {limit} bytes while it was read", path)
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns) or total != st.st_size:
            raise FileChangedError(f"{path} changed while it was read", path)
        return b"".join(parts)
    finally:
        os.close(fd)


@contextmanager
def pacing(pacer: Callable[[int], None] | None) -> Iterator[None]:
    """Within the block, this thread calls ``pacer`` with the size of each ``fold`` read (after use) and ``pread``
    (after the read); it may wait, and changes nothing read."""
    before = getattr(_local, "pacer", None)
    _local.pacer = pacer
    try:
        yield
    finally:
        _local.pacer = before


def _buffer() -> memoryview:
    """This thread's read buffer: an anonymous mapping (page-aligned, so reads land in it at full speed)."""
    view = getattr(_local, "view", None)
    if view is None:
        _local.mapping = mmap.mmap(-1, READ_BYTES)
        view = _local.view = memoryview(_local.mapping)
    return view


class ReadOnlyFile(Folding):
    """A regular file opened read-only, with ranged reads and hashing; a URL opens a ``RemoteFile`` instead.

    ``size`` is the size at open; reads stay inside it; a short read or a changed ``fstat`` is
    :class:`~ckptverify.errors.FileChangedError`. At most :data:`MAX_OPEN` descriptors are held process-wide (one
    file per item may exceed the process limit): idle ones are closed LRU and reopened, which must find the same,
    unchanged file. ``keep_bytes``: a file that small is read whole at open and served from memory until
    :meth:`release_kept`.
    """

    def __new__(cls, path: str, *, root: str | None = None, real_root: str | None = None,
                keep_bytes: int = 0) -> ReadOnlyFile:
        if cls is ReadOnlyFile and is_url(path):
            from ckptverify.safeparse.remote import RemoteFile

            return RemoteFile(path, root=root)  # type: ignore[return-value]
        return super().__new__(cls)

    def __init__(self, path: str, *, root: str | None = None, real_root: str | None = None,
                 keep_bytes: int = 0) -> None:
        self.path = path
        self._root = root
        # A reopen checks the path against the root as resolved at open (a moved root is refused).
        self._real_root = (real_root or os.path.realpath(root)) if root is not None else None
        fd, st, target = _open_regular(path, root, self._real_root)
        # The resolved path opened, for a quick reopen (see _reopen); only where it was resolved.
        self._target = target if root is not None else None
        self.size = st.st_size
        self._signature = _signature(st)
        self._fd: int | None = fd
        self._pins = 0
        self._closed = False
        #: The whole file, read at open when it holds at most ``keep_bytes`` (see :meth:`release_kept`).
        self._kept: bytes | None = None
        if 0 < self.size <= keep_bytes:
            try:
                data = os.pread(fd, self.size, 0)
            except OSError:
                data = b""
            # A short read is left to the reads that need the bytes: they say the file changed.
            self._kept = data if len(data) == self.size else None
        _DESCRIPTORS.added(self)

    @property
    def kept(self) -> int:  # type: ignore[override]
        return len(self._kept) if self._kept is not None else 0

    def release_kept(self) -> None:
        self._kept = None

    def close(self) -> None:
        _DESCRIPTORS.closed(self)

    @contextmanager
    def _descriptor(self) -> Iterator[int]:
        """The open descriptor, kept open while the block runs."""
        fd = _DESCRIPTORS.pin(self)
        try:
            yield fd
        finally:
            _DESCRIPTORS.unpin(self)

    def _reopen(self) -> int:
        """Reopen after the descriptor was closed for :data:`MAX_OPEN`; it must be the same, unchanged file."""
        fd = self._reopen_same()
        if fd is not None:
            return fd
        try:
            fd, st = open_regular(self.path, root=self._root, real_root=self._real_root)
        except OSError as exc:
            how = f"its name no longer opens it ({exc.strerror or exc})"
        else:
            if _signature(st) == self._signature:
                return fd
            os.close(fd)
            how = self._describe(st)
        raise FileChangedError(f"{self.path} changed while it was verified: {how}", self.path)

    def _reopen_same(self) -> int | None:
        """Quick reopen: the resolved path still names a regular file of this signature, opened without following links,
        so it is the file checked at first open. ``None`` if anything differs (the full :func:`open_regular` runs)."""
        target = self._target
        if target is None:
            return None
        try:
            before = os.lstat(target)  # never open what is no regular file now (a device swapped in)
            if not stat.S_ISREG(before.st_mode) or _signature(before) != self._signature:
                return None
            fd = os.open(target, _OPEN_FLAGS | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and _signature(st) == self._signature:
                return fd
        except OSError:
            pass
        os.close(fd)
        return None

    def _describe(self, now: os.stat_result) -> str:
        if (now.st_dev, now.st_ino) != self._signature[2:]:
            return "its name now names another file (replaced)"
        return (f"it was {self._signature[0]} bytes modified at {self._signature[1]} ns when opened, and "
                f"is {now.st_size} bytes modified at {now.st_mtime_ns} ns now")

    def changed(self) -> str | None:
        """How the file differs from open (size, mtime, or its name naming another file), or ``None``."""
        fd = _DESCRIPTORS.pin_if_open(self)
        now = None  # closed to stay under MAX_OPEN: what its name opens must be the file, unchanged
        if fd is not None:
            try:
                now = os.fstat(fd)
            finally:
                _DESCRIPTORS.unpin(self)
            if _signature(now) != self._signature:
                return self._describe(now)
        try:
            named = os.stat(self.path)
        except OSError as exc:
            return f"its name no longer opens it ({exc.strerror})"
        if now is None:
            return None if _signature(named) == self._signature else self._describe(named)
        if (named.st_dev, named.st_ino) != (now.st_dev, now.st_ino):
            return "its name now names another file (replaced)"
        return None

    def pread(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the file as opened, none past it)."""
        if n <= 0 or offset >= self.size:
            return b""
        want = min(n, self.size - offset)
        kept = self._kept  # read once: another thread may release it
        if kept is not None:
            data = kept[offset:offset + want]
        else:
            with self._descriptor() as fd:
                data = os.pread(fd, want, offset)
                while len(data) < want:  # a short read is legal; a read at end of file inside ``size`` is not
                    more = os.pread(fd, want - len(data), offset + len(data))
                    if not more:
                        raise self._shrunk(offset + len(data))
                    data += more
        pace = getattr(_local, "pacer", None)
        if pace is not None:  # the deep check rebuilds tensors from these reads: it is paced as the hashing is
            pace(len(data))
        return data

    def fold_at(self, start: int, end: int, fn: Callable[[memoryview, int], None]) -> None:
        """Like :meth:`fold`, also passing each view's offset in the file."""
        end = min(end, self.size)
        buf = _buffer()
        pace = getattr(_local, "pacer", None)
        pos = start
        with self._descriptor() as fd:
            while pos < end:
                with buf[: min(READ_BYTES, end - pos)] as window:
                    got = os.preadv(fd, [window], pos)
                if got == 0:
                    raise self._shrunk(pos)
                with buf[:got] as part:
                    fn(part, pos)
                if pace is not None:
                    pace(got)
                pos += got

    def _shrunk(self, at: int) -> FileChangedError:
        return FileChangedError(f"{self.path} ends at byte {at} now but was {self.size} bytes when opened", self.path)


#: Most descriptors held open at once: well under the usual limit of 1024 per process.
MAX_OPEN = 256


class _Descriptors:
    """Open descriptors of all :class:`ReadOnlyFile` s, at most :data:`MAX_OPEN` (beyond only while reads pin them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[ReadOnlyFile, None] = OrderedDict()  # least recently used first

    def added(self, f: ReadOnlyFile) -> None:
        with self._lock:
            self._open[f] = None
            self._evict()

    def pin(self, f: ReadOnlyFile) -> int:
        with self._lock:
            if f._closed:
                raise ValueError(f"{f.path} is closed")
            if f._fd is None:
                f._fd = f._reopen()
                self._open[f] = None
                self._evict(keep=f)
            else:
                self._open.move_to_end(f)
            f._pins += 1
            return f._fd

    def pin_if_open(self, f: ReadOnlyFile) -> int | None:
        """:meth:`pin` if the descriptor is open, else ``None`` (nothing opened)."""
        with self._lock:
            if f._fd is None:
                return None
            f._pins += 1
            return f._fd

    def unpin(self, f: ReadOnlyFile) -> None:
        with self._lock:
            f._pins -= 1

    def closed(self, f: ReadOnlyFile) -> None:
        with self._lock:
            f._closed = True
            self._open.pop(f, None)
            if f._fd is not None:
                os.close(f._fd)
                f._fd = None

    def _evict(self, keep: ReadOnlyFile | None = None) -> None:
        while len(self._open) > MAX_OPEN:
            victim = next((f for f in self._open if f is not keep and f._pins == 0), None)
            if victim is None:
                return  # every one is in use: over the limit until a read ends
            del self._open[victim]
            os.close(victim._fd)  # type: ignore[arg-type]
            victim._fd = None


_DESCRIPTORS = _Descriptors()


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)
