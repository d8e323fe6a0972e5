"""The files ckptverify writes into or beside a checkpoint: their names, and how they are written.

Every check that lists a checkpoint's files must know these names, so that ckptverify's own files are never
reported as part of (or missing from) the checkpoint, and a half-written one is recognised as ckptverify's.
They are written with :func:`write_atomic`: a reader sees the old content or the new, never a part of either.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_TEMP_PREFIX",
    "METRICS_TEMP_PREFIX",
    "OWN_FILES",
    "SAVE_MARKER",
    "STAMP_FILE",
    "STAMP_TEMP_PREFIX",
    "SUSPECT_NOTE",
    "VERIFYING_LOCK",
    "write_atomic",
]

#: A checkpoint folder's manifest (``NAME.ckptverify.manifest.json`` beside a single-file checkpoint).
MANIFEST_FILE = "ckptverify.manifest.json"
#: A checkpoint's verification stamp (inside a folder; ``NAME.ckptverify.verified.json`` beside a file).
STAMP_FILE = "ckptverify.verified.json"
#: Written into a checkpoint folder before its save when the job saw its replicas disagree: the checkpoint is
#: suspect (``ckptverify.runs.stamp.read_suspect``), whatever its bytes verify to.
SUSPECT_NOTE = "ckptverify.suspect.json"
#: Held (``flock``) by whoever is verifying a checkpoint right now; retention skips a locked checkpoint.
VERIFYING_LOCK = ".ckptverify-verifying"
#: The in-progress marker (and lock file) of a ckptverify save that has not committed.
SAVE_MARKER = ".ckptverify-save-in-progress"
#: The temporary files a manifest, a stamp and a metrics file are written to before they are renamed.
MANIFEST_TEMP_PREFIX = ".ckptverify-manifest-"
STAMP_TEMP_PREFIX = ".ckptverify-stamp-"
METRICS_TEMP_PREFIX = ".ckptverify-metrics-"
#: The files ckptverify may leave in a checkpoint folder once it is done: never part of the checkpoint.
OWN_FILES = frozenset({MANIFEST_FILE, STAMP_FILE, VERIFYING_LOCK, SUSPECT_NOTE})


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, prefix: str, durable: bool = True) -> str:
    """Replace ``path`` with ``data`` at once: written to a temporary file named ``prefix...`` in the same folder,
    then renamed over ``path``; the temporary file is removed if anything fails. ``durable``: the data and the
    rename are flushed to disk (``fsync`` of the file, then of the folder) before this returns. The file gets
    the permissions any new file there would get (the umask's). Returns the path written."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp creates 0600
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
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
