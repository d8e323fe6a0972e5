"""The verification stamp ``ckptverify.verified.json``, written atomically beside a verified checkpoint
(``NAME.ckptverify.verified.json`` beside a single file).

It records the verdict, its strength (``state``: a stamp never ranks a checkpoint higher), what was checked and a
fingerprint of the files (name, size, mtime, inode). Traps: a stamp is *current* only while that fingerprint and the
manifest digest match, and a stale one is never trusted; it is a cache, not evidence against someone who can write
the directory (``docs/security.md``). A suspect note (saved after a replica mismatch) is copied into the stamp
(``"verdict": "suspect"``) and keeps the checkpoint from ever being picked."""

from __future__ import annotations

import datetime as _dt
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

import xxhash

from ckptverify._version import __version__
from ckptverify.findings import Report
from ckptverify.formats.rundir import dir_format
from ckptverify.ownfiles.names import (
    MANIFEST_FILE,
    PARTS_PREFIX,
    SAVE_MARKER,
    STAMP_FILE,
    STAMP_TEMP_PREFIX,
    SUSPECT_NOTE,
    VERIFYING_LOCK,
    own_folder,
    write_atomic,
)
from ckptverify.ownfiles.partsplan import read_json
from ckptverify.runs.states import STATES, judge_report
from ckptverify.safeparse import paths, safejson
from ckptverify.safeparse.readers import read_small_file

__all__ = ["SETTLE_SECONDS", "Stamp", "committed", "describe_suspect", "files_fingerprint", "read_stamp",
           "read_suspect", "removed", "stamp_path", "write_stamp", "write_suspect_note"]

STAMP_SCHEMA = "ckptverify/stamp"
STAMP_VERSION = 1
SUSPECT_SCHEMA = "ckptverify/suspect"
#: The most of a stamp that is ever read.
MAX_STAMP_BYTES = 1 << 20
#: How long a checkpoint that looks damaged must stay in place before it is judged so: retention deletes file by
#: file, and a checkpoint on its way out is not corrupt.
SETTLE_SECONDS = 1.0
_IGNORED = frozenset({STAMP_FILE, VERIFYING_LOCK})
_METADATA = ".metadata"


def committed(path: str) -> bool:
    """Whether ``path`` holds a DCP checkpoint whose save finished: its ``.metadata`` is in place and no
    ckptverify save is in progress in it."""
    try:
        names = set(paths.listdir(path))
    except OSError:  # gone (retention), or not a directory
        return False
    has_metadata = _METADATA in names or any(n.startswith("__") and n.endswith(".metadata") for n in names)
    return has_metadata and SAVE_MARKER not in names


def removed(path: str) -> bool:
    """Whether the checkpoint at ``path`` was removed (or, for DCP, lost its metadata: retention under way); asked
    before any verdict calls such damage corruption."""
    if paths.isdir(path):
        try:
            names = paths.listdir(path)
        except OSError:
            return True
        fmt = dir_format(names)
        return fmt == "dcp-uncommitted" or (fmt == "dcp" and SAVE_MARKER in names)
    return not paths.isfile(path)


def stamp_path(checkpoint: str | os.PathLike[str], name: str = STAMP_FILE) -> str:
    """Where the stamp (or another of ckptverify's files, ``name``) of ``checkpoint`` lives: inside a directory, beside
    a single file."""
    path = os.fspath(checkpoint)
    if paths.isdir(path) and not paths.islink(path):
        return os.path.join(path, name)
    return f"{path}.{name}"


def files_fingerprint(root: str) -> str:
    """xxh3-128 over (relative path, type, size, mtime_ns, inode) of every file under ``root``, links not followed,
    the stamp, lock and part verdicts excluded; of ``root`` itself when not a directory."""
    h = xxhash.xxh3_128()
    entries: list[str] = []
    if not paths.isdir(root) or paths.islink(root):
        try:
            st = paths.lstat(root)
        except OSError:
            return h.hexdigest()
        h.update(f"{stat.S_IFMT(st.st_mode)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
        return h.hexdigest()
    walk = paths.FolderWalk(root)
    for e, st in walk.files():
        rel = os.path.relpath(e.path, root)
        if rel in _IGNORED or e.name.startswith((STAMP_TEMP_PREFIX, PARTS_PREFIX)):
            continue
        entries.append(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}")
    # What the bounded walk did not see changes the fingerprint too (the verification reports it as unseen).
    entries.extend(f"\1{p.kind}\0{p.path}" for p in walk.problems)
    for line in sorted(entries):
        h.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


@dataclass(frozen=True)
class Stamp:
    """A stamp as read back; ``current``: the directory is still what was verified."""

    passed: bool
    data: dict[str, Any]
    current: bool

    @property
    def step(self) -> int | None:
        value = self.data.get("step")
        return value if isinstance(value, int) else None

    @property
    def state(self) -> str | None:
        """The recorded strength (a :data:`~ckptverify.runs.states.STATES` value), or ``None`` for a stamp without
        one (never worth more than a fresh verification)."""
        value = self.data.get("state")
        return value if isinstance(value, str) and value in STATES else None

    @property
    def suspect(self) -> dict[str, Any] | None:
        """The suspect note recorded in the stamp (see the module docstring), or ``None``."""
        value = self.data.get("suspect")
        return value if isinstance(value, dict) else None


def _read(path: str, limit: int) -> bytes | None:
    """A small regular file's bytes (never a FIFO, device or link; capped), or ``None``."""
    try:
        return read_small_file(path, limit)
    except OSError:
        return None


def _manifest_digest(root: str) -> str | None:
    from ckptverify.fingerprint import digest_bytes

    raw = _read(stamp_path(root, MANIFEST_FILE), 256 << 20)
    return None if raw is None else digest_bytes(raw)


def write_stamp(root: str | os.PathLike[str], report: Report, *, step: int | None = None,
                fingerprint: str | None = None, throttled_s: float | None = None,
                parts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write the stamp for ``report`` (a ``verify`` report of ``root``); return what was written. ``fingerprint``
    should be taken *before* verifying, so a file changed meanwhile leaves the stamp already stale. ``throttled_s``
    and ``parts`` (a verification shared among nodes) are recorded when given."""
    folder = os.fspath(root)
    suspect = _read_note(folder)
    data = {
        "schema": STAMP_SCHEMA,
        "schema_version": STAMP_VERSION,
        "tool_version": __version__,
        # A failure of the bytes outranks the suspicion.
        "verdict": "failed" if not report.passed else "suspect" if suspect is not None else "passed",
        "passed": report.passed,
        # A stamp ranks a checkpoint no higher than this.
        "state": judge_report(report),
        "summary": report.summary(),
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
    data.update((k, v) for k, v in (("throttled_s", throttled_s), ("parts", parts), ("suspect", suspect))
                if v is not None)
    text = json.dumps(data, indent=1, default=str)
    if paths.is_url(folder):  # one PUT: an object appears whole or not at all, as the rename makes a file
        from ckptverify.safeparse import remote

        remote.put_small(stamp_path(folder), text.encode())
    else:
        write_atomic(stamp_path(folder), text, prefix=STAMP_TEMP_PREFIX)
    return data


def read_stamp(root: str | os.PathLike[str]) -> Stamp | None:
    """The stamp of ``root``, or ``None`` when there is none or it cannot be read as one (never trusted then)."""
    folder = os.fspath(root)
    data = read_json(stamp_path(folder), MAX_STAMP_BYTES)
    if data is None or data.get("schema") != STAMP_SCHEMA or not isinstance(data.get("passed"), bool):
        return None
    current = (data.get("files_fingerprint") == files_fingerprint(folder)
               and data.get("manifest_digest") == _manifest_digest(folder))
    return Stamp(passed=data["passed"], data=data, current=current)


def _read_note(checkpoint: str) -> dict[str, Any] | None:
    raw = _read(stamp_path(checkpoint, SUSPECT_NOTE), MAX_STAMP_BYTES)
    if raw is None:
        return None
    try:
        data = safejson.loads(raw)
    except (ValueError, UnicodeDecodeError):
        # Unreadable, but it was written to say the checkpoint is suspect: it stays suspect.
        return {"schema": SUSPECT_SCHEMA, "reason": f"its suspect note {SUSPECT_NOTE} cannot be read"}
    return data if isinstance(data, dict) else {"schema": SUSPECT_SCHEMA,
                                                 "reason": f"its suspect note {SUSPECT_NOTE} is not an object"}


def write_suspect_note(checkpoint: str | os.PathLike[str], record: dict[str, Any]) -> str:
    """Write the suspect note into ``checkpoint`` (created if missing, never through a link) before it is saved into;
    return its path."""
    folder = os.path.abspath(checkpoint)
    own_folder(folder)  # never written through a link at its name
    data = {"schema": SUSPECT_SCHEMA, **record}
    return write_atomic(stamp_path(folder, SUSPECT_NOTE), json.dumps(data, indent=1, default=str),
                        prefix=STAMP_TEMP_PREFIX)


def read_suspect(checkpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Why ``checkpoint`` is suspect (its note, else its stamp's record, current or not: a later file change does not
    clear a suspicion about the saved state), or ``None``."""
    folder = os.fspath(checkpoint)
    note = _read_note(folder)
    if note is not None:
        return note
    data = read_json(stamp_path(folder), MAX_STAMP_BYTES)
    value = data.get("suspect") if data is not None else None
    return value if isinstance(value, dict) else None


def describe_suspect(record: dict[str, Any]) -> str:
    """One line saying why a checkpoint is suspect."""
    if record.get("reason") and "first_step" not in record:
        return str(record["reason"])
    sides = "; ".join(f"ranks {s.get('ranks')}" for s in record.get("sides") or [] if isinstance(s, dict))
    count = record.get("mismatched_steps")
    steps = f"{count} mismatched step(s) from step {record.get('first_step')} to {record.get('last_step')}"
    state = "still differing" if record.get("ongoing") else "agreeing again"
    return (f"saved at step {record.get('step')} after a replica mismatch ({steps}; {sides or 'ranks unknown'}; "
            f"{state} at the save)")
