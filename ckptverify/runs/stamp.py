"""The verification stamp: ``ckptverify.verified.json``, written beside a checkpoint once it was verified.

A stamp records the verdict (passed or not, the counts, the first errors), its strength (``state``: verified by
a manifest, intact by CRCs, or uncheckable: a stamp never ranks a checkpoint higher than that), what was checked
(bytes, deep or not), the tool version, the time taken, the digest of the manifest, and a fingerprint of the
directory's files (name, size, modification time, inode of every file but the stamp itself). A stamp is
**current** only while that fingerprint still matches: a file rewritten, added, removed or touched after the
verification makes it stale, and a stale stamp is never trusted (the checkpoint is verified again). A stamp is
written atomically (a temporary file, then ``rename``), so a reader sees a whole stamp or none.

The stamp is a cache of a verification, not evidence against an attacker who can write the directory: such an
attacker can write a stamp too (``docs/security.md``).

A checkpoint that is a single file (a Lightning ``.ckpt``, a ``torch.save`` file) cannot hold its stamp: it is
kept beside it, as ``NAME.ckptverify.verified.json`` (:func:`stamp_path`), fingerprints that one file, and
digests the manifest kept beside it (``NAME.ckptverify.manifest.json``).

A checkpoint saved after the job saw its data-parallel replicas disagree is **suspect**: its bytes may verify,
but the state they hold is not one every replica agreed on. A production job writes a suspect note
(``ckptverify.suspect.json``: the step of the save, the first and last mismatched steps, how many, the ranks on
each side) into the folder before the save; the stamp copies it under ``suspect`` and says ``"verdict":
"suspect"`` (``passed`` still says whether the bytes verified). :func:`read_suspect` reads it from either;
``latest``/``load(pick=...)`` never pick a suspect checkpoint, ``scan`` shows it as ``suspect``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptverify.findings import Report
from ckptverify.ownfiles.names import (
    PARTS_PREFIX,
    SAVE_MARKER,
    STAMP_FILE,
    STAMP_TEMP_PREFIX,
    SUSPECT_NOTE,
    VERIFYING_LOCK,
    own_folder,
    write_atomic,
)
from ckptverify.safeparse import paths, safejson

__all__ = ["STAMP_FILE", "SUSPECT_NOTE", "VERIFYING_LOCK", "Stamp", "committed", "describe_suspect",
           "files_fingerprint", "read_stamp", "read_suspect", "removed", "stamp_path", "write_stamp",
           "write_suspect_note"]

STAMP_SCHEMA = "ckptverify/stamp"
STAMP_VERSION = 2
SUSPECT_SCHEMA = "ckptverify/suspect"
#: The most of a stamp that is ever read.
MAX_STAMP_BYTES = 1 << 20
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
    """Whether the checkpoint at ``path`` was removed (or, for DCP, lost its metadata: retention under way).
    What every verdict on a checkpoint that may be deleted meanwhile (``scan``, the stamper, the background
    verifier) asks before it calls damage corruption."""
    if paths.isdir(path):
        from ckptverify.formats.rundir import dir_format

        try:
            names = paths.listdir(path)
        except OSError:
            return True
        return dir_format(names) == "dcp-uncommitted" or (dir_format(names) == "dcp" and not committed(path))
    return not paths.isfile(path)


def stamp_path(checkpoint: str | os.PathLike[str]) -> str:
    """Where the stamp of ``checkpoint`` lives: inside a directory, beside a single file."""
    path = os.fspath(checkpoint)
    if paths.isdir(path) and not paths.islink(path):
        return os.path.join(path, STAMP_FILE)
    return f"{path}.{STAMP_FILE}"


def files_fingerprint(root: str) -> str:
    """xxh3-128 over (relative path, size, mtime_ns, inode) of every file under ``root``, links not followed,
    the stamp, the verifying lock and the part verdicts of a shared verification excluded; of ``root`` itself
    when it is not a directory."""
    import xxhash

    from ckptverify.formats.rundir import walk_files

    h = xxhash.xxh3_128()
    entries: list[str] = []
    if not paths.isdir(root) or paths.islink(root):
        try:
            st = paths.lstat(root)
        except OSError:
            return h.hexdigest()
        h.update(f"{stat.S_IFMT(st.st_mode)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
        return h.hexdigest()
    for e, st in walk_files(root):
        rel = os.path.relpath(e.path, root)
        if rel in _IGNORED or e.name.startswith((STAMP_TEMP_PREFIX, PARTS_PREFIX)):
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

    @property
    def state(self) -> str | None:
        """What the verification could establish (``runs.scan``'s states: ``verified`` by a manifest, ``intact``
        by CRCs, ``uncheckable`` when nothing could check the content, ...), or ``None`` for a stamp that does
        not record it (a stamp of an older version: never worth more than a fresh verification)."""
        from ckptverify.runs.states import STATES

        value = self.data.get("state")
        return value if isinstance(value, str) and value in STATES else None

    @property
    def suspect(self) -> dict[str, Any] | None:
        """The suspect note recorded in the stamp (see the module docstring), or ``None``."""
        value = self.data.get("suspect")
        return value if isinstance(value, dict) else None


def _read(path: str, limit: int) -> bytes | None:
    """A small regular file's bytes (never a FIFO, device or link; capped), or ``None``."""
    from ckptverify.safeparse.readers import read_small_file

    try:
        return read_small_file(path, limit)
    except OSError:
        return None


def _manifest_digest(root: str) -> str | None:
    from ckptverify.fingerprint import digest_bytes
    from ckptverify.ownfiles.manifest import MANIFEST_FILE, file_manifest_name

    if paths.isdir(root) and not paths.islink(root):
        where = os.path.join(root, MANIFEST_FILE)
    else:  # a single file's manifest is beside it
        head, base = os.path.split(root if paths.is_url(root) else os.path.abspath(root))
        where = os.path.join(head, file_manifest_name(base))
    raw = _read(where, 256 << 20)
    return None if raw is None else digest_bytes(raw)


def write_stamp(root: str | os.PathLike[str], report: Report, *, step: int | None = None,
                fingerprint: str | None = None, throttled_s: float | None = None,
                parts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write the stamp for ``report`` (a ``verify`` report of ``root``) at :func:`stamp_path`; return what was
    written.

    ``fingerprint``: :func:`files_fingerprint` taken *before* the verification began (default: now). Taking it
    before means a file changed during the verification leaves a stamp that is already stale.
    ``throttled_s``: seconds of the verification spent waiting for an idle core (recorded when given).
    ``parts``: of a verification shared out among nodes, each node's part (node, host, ranks, files, bytes,
    verdict: :mod:`ckptverify.verifier.parts`), recorded when given.
    """
    from ckptverify._version import __version__
    from ckptverify.runs.states import judge_report

    folder = os.fspath(root)
    counts = report.summary()
    suspect = _read_note(folder)
    data = {
        "schema": STAMP_SCHEMA,
        "schema_version": STAMP_VERSION,
        "tool_version": __version__,
        # A failure of the bytes outranks the suspicion: such a checkpoint is failed, whatever else it is.
        "verdict": "failed" if not report.passed else "suspect" if suspect is not None else "passed",
        "passed": report.passed,
        # How strong the verdict is: a stamp ranks a checkpoint no higher than this (never "verified" for
        # content nothing could check).
        "state": judge_report(report),
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
    if parts is not None:
        data["parts"] = parts
    if suspect is not None:
        data["suspect"] = suspect
    text = json.dumps(data, indent=1, default=str)
    if paths.is_url(folder):  # one PUT: an object appears whole or not at all, as the rename makes a file
        from ckptverify.safeparse import remote

        remote.put_small(stamp_path(folder), text.encode())
    else:
        write_atomic(stamp_path(folder), text, prefix=STAMP_TEMP_PREFIX)
    return data


def _stamp_data(folder: str) -> dict[str, Any] | None:
    """The stamp file of ``folder`` parsed, when it is a JSON object; else ``None``."""
    raw = _read(stamp_path(folder), MAX_STAMP_BYTES)
    if raw is None:
        return None
    try:
        data = safejson.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_stamp(root: str | os.PathLike[str]) -> Stamp | None:
    """The stamp of ``root``, or ``None`` when there is none or it cannot be read as one (never trusted then)."""
    folder = os.fspath(root)
    data = _stamp_data(folder)
    if data is None or data.get("schema") != STAMP_SCHEMA or not isinstance(data.get("passed"), bool):
        return None
    current = (data.get("files_fingerprint") == files_fingerprint(folder)
               and data.get("manifest_digest") == _manifest_digest(folder))
    return Stamp(passed=data["passed"], data=data, current=current)


def _note_path(checkpoint: str) -> str:
    if paths.isdir(checkpoint) and not paths.islink(checkpoint):
        return os.path.join(checkpoint, SUSPECT_NOTE)
    return f"{checkpoint}.{SUSPECT_NOTE}"


def _read_note(checkpoint: str) -> dict[str, Any] | None:
    raw = _read(_note_path(checkpoint), MAX_STAMP_BYTES)
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
    """Write the suspect note of ``checkpoint`` (a folder, created if missing) before it is saved into; return
    its path. ``record``: what made it suspect (see :meth:`ckptverify.hardware.replica.ReplicaCheck.suspect`)."""
    folder = os.path.abspath(checkpoint)
    own_folder(folder)  # never written through a link at its name
    data = {"schema": SUSPECT_SCHEMA, **record}
    return write_atomic(_note_path(folder), json.dumps(data, indent=1, default=str), prefix=STAMP_TEMP_PREFIX)


def read_suspect(checkpoint: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Why ``checkpoint`` is suspect (its note, else what a stamp recorded, current or not: the suspicion is
    about the state saved, which a later change to the files does not clear), or ``None`` when it is not."""
    folder = os.fspath(checkpoint)
    note = _read_note(folder)
    if note is not None:
        return note
    data = _stamp_data(folder)
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
