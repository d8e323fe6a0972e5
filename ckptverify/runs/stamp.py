"""The verification stamp: ``ckptverify.verified.json``, written beside a checkpoint once it was verified.

A stamp records the verdict (passed or not, the counts, the first errors), what was checked (bytes, deep or
not), the tool version, the time taken, the digest of the manifest, and a fingerprint of the directory's files
(name, size, modification time, inode of every file but the stamp itself). A stamp is **current** only while
that fingerprint still matches: a file rewritten, added, removed or touched after the verification makes it
stale, and a stale stamp is never trusted (the checkpoint is verified again). A stamp is written atomically (a
temporary file, then ``rename``), so a reader sees a whole stamp or none.

The stamp is a cache of a verification, not evidence against an attacker who can write the directory: such an
attacker can write a stamp too (``docs/security.md``).

A checkpoint that is a single file (a Lightning ``.ckpt``, a ``torch.save`` file) cannot hold its stamp: it is
kept beside it, as ``NAME.ckptverify.verified.json`` (:func:`stamp_path`), fingerprints that one file, and
digests the manifest kept beside it (``NAME.ckptverify.manifest.json``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptverify.findings import Report
from ckptverify.own_files import STAMP_FILE, STAMP_TEMP_PREFIX, VERIFYING_LOCK, write_atomic

__all__ = ["STAMP_FILE", "VERIFYING_LOCK", "Stamp", "files_fingerprint", "read_stamp", "stamp_path", "write_stamp"]

STAMP_SCHEMA = "ckptverify/stamp"
STAMP_VERSION = 1
#: The most of a stamp that is ever read.
MAX_STAMP_BYTES = 1 << 20
_IGNORED = frozenset({STAMP_FILE, VERIFYING_LOCK})


def stamp_path(checkpoint: str | os.PathLike[str]) -> str:
    """Where the stamp of ``checkpoint`` lives: inside a directory, beside a single file."""
    path = os.fspath(checkpoint)
    if os.path.isdir(path) and not os.path.islink(path):
        return os.path.join(path, STAMP_FILE)
    return f"{path}.{STAMP_FILE}"


def files_fingerprint(root: str) -> str:
    """xxh3-128 over (relative path, size, mtime_ns, inode) of every file under ``root``, links not followed,
    the stamp and the verifying lock excluded; of ``root`` itself when it is not a directory."""
    import xxhash

    from ckptverify.formats.rundir import walk_files

    h = xxhash.xxh3_128()
    entries: list[str] = []
    if not os.path.isdir(root) or os.path.islink(root):
        try:
            st = os.lstat(root)
        except OSError:
            return h.hexdigest()
        h.update(f"{stat.S_IFMT(st.st_mode)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
        return h.hexdigest()
    for e, st in walk_files(root):
        rel = os.path.relpath(e.path, root)
        if rel in _IGNORED or e.name.startswith(STAMP_TEMP_PREFIX):
            continue
        entries.append(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}")
    for line in sorted(entries):
        h.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class Stamp:
    """A stamp as read back. ``current`` says whether the directory is still what was verified."""

    passed: bool
    data: dict[str, Any]
    current: bool

    @property
    def step(self) -> int | None:
        value = self.data.get("step")
        return value if isinstance(value, int) else None


def _read(path: str, limit: int) -> bytes | None:
    """A small regular file's bytes (never a FIFO, device or link; capped), or ``None``."""
    from ckptverify.readers import read_small_file

    try:
        return read_small_file(path, limit)
    except OSError:
        return None


def _manifest_digest(root: str) -> str | None:
    from ckptverify.fingerprint import digest_bytes
    from ckptverify.manifest import MANIFEST_FILE, file_manifest_name

    if os.path.isdir(root) and not os.path.islink(root):
        where = os.path.join(root, MANIFEST_FILE)
    else:  # a single file's manifest is beside it
        head, base = os.path.split(os.path.abspath(root))
        where = os.path.join(head, file_manifest_name(base))
    raw = _read(where, 256 << 20)
    return None if raw is None else digest_bytes(raw)


def write_stamp(root: str | os.PathLike[str], report: Report, *, step: int | None = None,
                fingerprint: str | None = None, throttled_s: float | None = None) -> dict[str, Any]:
    """Write the stamp for ``report`` (a ``verify`` report of ``root``) at :func:`stamp_path`; return what was
    written.

    ``fingerprint``: :func:`files_fingerprint` taken *before* the verification began (default: now). Taking it
    before means a file changed during the verification leaves a stamp that is already stale.
    ``throttled_s``: seconds of the verification spent waiting for an idle core (recorded when given).
    """
    from ckptverify import __version__

    folder = os.fspath(root)
    counts = report.summary()
    data = {
        "schema": STAMP_SCHEMA,
        "schema_version": STAMP_VERSION,
        "tool_version": __version__,
        "verdict": "passed" if report.passed else "failed",
        "passed": report.passed,
        "summary": counts,
        "errors": [f.to_dict() for f in report.errors[:20]],
        "coverage": [c.to_dict() for c in report.coverage],
        "bytes_checked": report.stats.get("bytes"),
        "seconds": report.stats.get("seconds"),
        "deep": bool(report.stats.get("deep")),
        "manifest": bool(report.stats.get("manifest")),
        "manifest_digest": _manifest_digest(folder),
        "files_fingerprint": fingerprint or files_fingerprint(folder),
        "step": step,
        "checked_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    if throttled_s is not None:
        data["throttled_s"] = throttled_s
    write_atomic(stamp_path(folder), json.dumps(data, indent=1, default=str), prefix=STAMP_TEMP_PREFIX)
    return data


def read_stamp(root: str | os.PathLike[str]) -> Stamp | None:
    """The stamp of ``root``, or ``None`` when there is none or it cannot be read as one (never trusted then)."""
    folder = os.fspath(root)
    raw = _read(stamp_path(folder), MAX_STAMP_BYTES)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("schema") != STAMP_SCHEMA or not isinstance(data.get("passed"), bool):
        return None
    current = (data.get("files_fingerprint") == files_fingerprint(folder)
               and data.get("manifest_digest") == _manifest_digest(folder))
    return Stamp(passed=data["passed"], data=data, current=current)
