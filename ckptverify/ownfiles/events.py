"""``events.jsonl``: the append-only log of what happened to a production run.

One JSON object per line, each with ``event`` (a stable name: ``save``, ``replica-mismatch``,
``checkpoint-verified``, ...), ``schema_version`` (:data:`EVENTS_SCHEMA_VERSION`), ``time`` (UTC, ISO 8601),
``rank`` and ``host``, plus the event's own fields; every name and its fields are listed in
``docs/json-schema.md``.

A checkpoint's verification after it was saved (by a save with ``verify=``, a production run, or a framework
integration) is one of the :data:`VERIFICATION_EVENTS`, whose fields are those of
:class:`~ckptverify.verifier.verification.Verification`. Logs written before version 2 named the ones of a save
with ``verify=`` otherwise (``verified``, ``verify-failed``, ``verify-skipped``, ``verify-cut-short``) and called
``bytes_checked`` ``checked_bytes`` in the integrations' events: :func:`read_events` reads them under today's
names (:data:`OLD_EVENT_NAMES`). Every line is written with one
``write`` on a file opened ``O_APPEND``, so lines from several ranks and processes never interleave (POSIX
appends of one buffer are atomic with respect to each other on local file systems), and a process killed
mid-run leaves at most its last line unwritten, never a torn one among whole ones.

The log is written and read only as a regular file (:func:`~ckptverify.ownfiles.names.open_append`): a symbolic
link, FIFO or device named ``events.jsonl`` is refused with
:class:`~ckptverify.ownfiles.names.NotRegularFileError` (an ``OSError``), never followed or waited on, so a FIFO
planted there cannot hang a training job or a watcher.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

from ckptverify.ownfiles.names import append_line, open_read
from ckptverify.safeparse import safejson

__all__ = ["CHECKPOINT_CUT_SHORT", "CHECKPOINT_DELETED", "CHECKPOINT_FAILED", "CHECKPOINT_UNVERIFIED",
           "CHECKPOINT_VERIFIED", "EVENTS_FILE", "EVENTS_SCHEMA_VERSION", "OLD_EVENT_NAMES", "VERIFICATION_EVENTS",
           "EventLog", "read_events", "upgrade_event"]

EVENTS_FILE = "events.jsonl"
#: Written into every event. Version 2: one vocabulary for verify-after-save (:data:`VERIFICATION_EVENTS`) and
#: ``bytes_checked`` everywhere; a line without ``schema_version`` is version 1.
EVENTS_SCHEMA_VERSION = 2

#: A saved checkpoint passed verification (stamped).
CHECKPOINT_VERIFIED = "checkpoint-verified"
#: A saved checkpoint failed verification (stamped), or could not be verified at all.
CHECKPOINT_FAILED = "checkpoint-failed"
#: A saved checkpoint was left without a verdict: its files changed while they were read, or the verification
#: itself stopped.
CHECKPOINT_UNVERIFIED = "checkpoint-unverified"
#: A saved checkpoint was deleted (retention) before its verification finished: no verdict, no failure.
CHECKPOINT_DELETED = "checkpoint-deleted"
#: The job stopped waiting for a saved checkpoint's verification (at its end): no verdict.
CHECKPOINT_CUT_SHORT = "checkpoint-cut-short"
#: The events that record a saved checkpoint's verification; their fields are a
#: :class:`~ckptverify.verifier.verification.Verification`'s.
VERIFICATION_EVENTS = (CHECKPOINT_VERIFIED, CHECKPOINT_FAILED, CHECKPOINT_UNVERIFIED, CHECKPOINT_DELETED,
                       CHECKPOINT_CUT_SHORT)
#: Names of version 1 -> today's.
OLD_EVENT_NAMES = {
    "verified": CHECKPOINT_VERIFIED,
    "verify-failed": CHECKPOINT_FAILED,
    "verify-skipped": CHECKPOINT_UNVERIFIED,
    "verify-cut-short": CHECKPOINT_CUT_SHORT,
}


class EventLog:
    """Appends events to ``DIR/events.jsonl`` for one rank."""

    def __init__(self, run_dir: str | os.PathLike[str], *, rank: int = 0) -> None:
        self.path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
        self.rank = rank
        self.host = socket.gethostname()
        os.makedirs(os.fspath(run_dir), exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return it as written. Raises ``OSError`` (among them
        :class:`~ckptverify.ownfiles.names.NotRegularFileError`) when it cannot be appended."""
        record: dict[str, Any] = {
            "event": event,
            "schema_version": EVENTS_SCHEMA_VERSION,
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
            "rank": self.rank,
            "host": self.host,
        }
        record.update(fields)
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        append_line(self.path, line)
        return record


def upgrade_event(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as today's version writes it: a version 1 event of a saved checkpoint's verification under its
    name of today (:data:`OLD_EVENT_NAMES`), with ``bytes_checked`` (for the integrations' ``checked_bytes``),
    ``verdict`` and ``passed``. Other events, and version 2 ones, are returned as they are."""
    version = record.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 2:
        return record
    name = record.get("event")
    if not isinstance(name, str) or (name not in OLD_EVENT_NAMES and name not in VERIFICATION_EVENTS):
        return record
    out = dict(record)
    out["event"] = OLD_EVENT_NAMES.get(name, name)
    if "checked_bytes" in out and "bytes_checked" not in out:
        out["bytes_checked"] = out.pop("checked_bytes")
    if "verdict" not in out:
        verdicts = {CHECKPOINT_VERIFIED: "passed", CHECKPOINT_FAILED: "failed"}
        out["verdict"] = verdicts.get(out["event"], "unverified")
    if "passed" not in out:
        out["passed"] = out["verdict"] == "passed"
    return out


def read_events(run_dir: str | os.PathLike[str], event: str | None = None) -> Iterator[dict[str, Any]]:
    """The events of a run, in file order (optionally only those named ``event``); a torn last line is skipped.
    Events of an earlier version are read as today's version writes them (:func:`upgrade_event`: the old name of
    an event, given as ``event``, selects it too). Raises :class:`~ckptverify.ownfiles.names.NotRegularFileError`
    when ``events.jsonl`` is not a regular file."""
    if event is not None:
        event = OLD_EVENT_NAMES.get(event, event)
    path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
    try:
        fd = open_read(path)
    except FileNotFoundError:
        return
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = safejson.loads(line)
            except ValueError:  # a torn or hostile line: not an event
                continue
            if not isinstance(record, dict):
                continue
            record = upgrade_event(record)
            if event is None or record.get("event") == event:
                yield record
