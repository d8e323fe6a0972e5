"""``events.jsonl``: the append-only log of what happened to a production run.

One JSON object per line, each with ``event`` (a stable name: ``save``, ``replica-mismatch``, ``warning``, ...),
``time`` (UTC, ISO 8601), ``rank`` and ``host``, plus the event's own fields. Every line is written with one
``write`` on a file opened ``O_APPEND``, so lines from several ranks and processes never interleave (POSIX
appends of one buffer are atomic with respect to each other on local file systems), and a process killed
mid-run leaves at most its last line unwritten, never a torn one among whole ones.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

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
        """Append one event and return it as written."""
        record: dict[str, Any] = {
            "event": event,
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
            "rank": self.rank,
            "host": self.host,
        }
        record.update(fields)
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_events(run_dir: str | os.PathLike[str], event: str | None = None) -> Iterator[dict[str, Any]]:
    """The events of a run, in file order (optionally only those named ``event``); a torn last line is skipped."""
    path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and (event is None or record.get("event") == event):
                yield record
