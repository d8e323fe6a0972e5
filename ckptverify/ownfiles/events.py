"""``events.jsonl``: the append-only log of what happened to a production run.

One JSON object per line, each with ``event`` (a stable name: ``save``, ``replica-mismatch``, ``warning``, ...),
``time`` (UTC, ISO 8601), ``rank`` and ``host``, plus the event's own fields. Every line is written with one
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

__all__ = ["EVENTS_FILE", "EventLog", "read_events"]

EVENTS_FILE = "events.jsonl"


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
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
            "rank": self.rank,
            "host": self.host,
        }
        record.update(fields)
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        append_line(self.path, line)
        return record


def read_events(run_dir: str | os.PathLike[str], event: str | None = None) -> Iterator[dict[str, Any]]:
    """The events of a run, in file order (optionally only those named ``event``); a torn last line is skipped.
    Raises :class:`~ckptverify.ownfiles.names.NotRegularFileError` when ``events.jsonl`` is not a regular file."""
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
            if isinstance(record, dict) and (event is None or record.get("event") == event):
                yield record
