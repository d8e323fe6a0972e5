"""The files ckptverify writes into or beside a checkpoint: their names, and how they are written.

Checks must know these names so our files are never reported as part of (or missing from) a checkpoint.
:func:`write_atomic` replaces whole files; :func:`open_append` opens logs. Neither writes through a non-regular
file (link, FIFO, device, socket: :class:`NotRegularFileError`), and opening never blocks. Our folders are made
with :func:`own_dir`/:func:`open_own_dir`: never through a link, never outside their parent.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile

from ckptverify.errors import NotRegularFileError
from ckptverify.safeparse.readers import file_kind

__all__ = ["MANIFEST_FILE", "MANIFEST_TEMP_PREFIX", "METRICS_TEMP_PREFIX", "OWN_FILES", "PARTS_PLAN", "PARTS_PREFIX",
           "SAVE_MARKER", "STAMP_FILE", "STAMP_TEMP_PREFIX", "SUSPECT_NOTE", "VERIFYING_LOCK", "append_line",
           "check_replaceable", "open_append", "open_own_dir", "open_read", "own_dir", "own_folder", "write_atomic"]

#: A checkpoint folder's manifest (``NAME.ckptverify.manifest.json`` beside a single-file checkpoint).
MANIFEST_FILE = "ckptverify.manifest.json"
#: A checkpoint's verification stamp (inside a folder; ``NAME.ckptverify.verified.json`` beside a file).
STAMP_FILE = "ckptverify.verified.json"
#: Written before a save after replicas disagreed: the checkpoint is suspect whatever its bytes verify to.
SUSPECT_NOTE = "ckptverify.suspect.json"
#: Held (``flock``) by whoever is verifying a checkpoint right now; retention skips a locked checkpoint.
VERIFYING_LOCK = ".ckptverify-verifying"
#: The in-progress marker (and lock file) of a ckptverify save that has not committed.
SAVE_MARKER = ".ckptverify-save-in-progress"
#: The parts plan and part verdicts (``.ckptverify-part-N.json``) of a verification shared among nodes, until
#: the stamp is written: never part of the checkpoint or its stamp's fingerprint.
PARTS_PREFIX = ".ckptverify-part"
PARTS_PLAN = ".ckptverify-parts.json"
#: The temporary files a manifest, a stamp and a metrics file are written to before they are renamed.
MANIFEST_TEMP_PREFIX = ".ckptverify-manifest-"
STAMP_TEMP_PREFIX = ".ckptverify-stamp-"
METRICS_TEMP_PREFIX = ".ckptverify-metrics-"
#: The files ckptverify may leave in a checkpoint folder once it is done: never part of the checkpoint.
OWN_FILES = frozenset({MANIFEST_FILE, STAMP_FILE, VERIFYING_LOCK, SUSPECT_NOTE})


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _refuse(path: str, mode: int) -> NotRegularFileError:
    return NotRegularFileError(errno.EEXIST, f"a {file_kind(mode)}, not a regular file: refusing to write through "
                                             f"or replace it", path)


def check_replaceable(path: str | os.PathLike[str]) -> None:
    """:class:`NotRegularFileError` if something other than a regular file (not followed) is at ``path``."""
    target = os.fspath(path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(target, st.st_mode)


def _open_own(target: str, flags: int, mode: int) -> int:
    check_replaceable(target)  # a device is never even opened (opening some has effects)
    try:
        fd = os.open(target, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # swapped in since the check: say what it is
            check_replaceable(target)
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(target, st.st_mode)
        os.set_blocking(fd, True)  # a regular file: no reason left not to block
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike[str], mode: int = 0o644) -> int:
    """A descriptor appending to regular file ``path`` (created if missing), opened without following links or blocking,
    then checked. :class:`NotRegularFileError` for anything else; ``OSError`` if it cannot be opened."""
    return _open_own(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)


def open_read(path: str | os.PathLike[str]) -> int:
    """A descriptor reading regular file ``path``, opened as :func:`open_append`; ``FileNotFoundError`` if absent."""
    return _open_own(os.fspath(path), os.O_RDONLY, 0)


def append_line(path: str | os.PathLike[str], line: bytes) -> None:
    """Append ``line`` to regular file ``path`` in one ``write``, so concurrent appends never interleave."""
    fd = open_append(path)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def open_own_dir(root: str | os.PathLike[str], *names: str) -> int:
    """A directory descriptor (caller closes) of ``root/names...``, each name created if missing and opened relative to
    the one above without following links (so it is inside ``root``; ``root`` itself is taken as named). A link or
    non-directory raises :class:`NotRegularFileError`. Work relative to the descriptor cannot be redirected by a
    swapped name."""
    where = os.fspath(root)
    os.makedirs(where, exist_ok=True)
    fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for name in names:
            if name in ("", ".", "..") or "/" in name or os.sep in name:
                raise ValueError(f"not one folder name: {name!r}")
            where = os.path.join(where, name)
            with contextlib.suppress(FileExistsError):  # made by another rank, or something else is there
                os.mkdir(name, 0o777, dir_fd=fd)
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                mode = os.lstat(name, dir_fd=fd).st_mode
                raise NotRegularFileError(errno.EEXIST, f"a {file_kind(mode)}, not a directory: refusing to make "
                                                        "or move anything into it", where) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_dir(root: str | os.PathLike[str], *names: str) -> str:
    """The path of the folder ``root/names...``, made and checked as :func:`open_own_dir` does."""
    os.close(open_own_dir(root, *names))
    return os.path.join(os.fspath(root), *names)


def own_folder(path: str | os.PathLike[str]) -> str:
    """Absolute path of folder ``path``, its last name made and checked as :func:`own_dir` does."""
    path = os.path.abspath(os.fspath(path))
    return own_dir(os.path.dirname(path), os.path.basename(path))


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, prefix: str, durable: bool = True) -> str:
    """Replace ``path`` with ``data`` at once via a temporary ``prefix...`` file renamed over it (removed on failure);
    ``durable`` fsyncs file and folder first. Permissions: the umask's. Returns the path. Only a regular file is
    replaced: anything else raises :class:`NotRegularFileError` (checked before writing and before the rename)."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    check_replaceable(target)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp creates 0600
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        check_replaceable(target)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return target


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` would race with other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
