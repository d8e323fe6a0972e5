"""``events.jsonl``: the append-only log of what happened to a production run (names and fields:
``docs/json-schema.md``).

One JSON object per line with ``event``, ``schema_version``, ``time`` (UTC ISO 8601), ``rank``, ``host`` and the
event's fields; verification events (:data:`VERIFICATION_EVENTS`) carry a
:class:`~ckptverify.verifier.verification.Verification`'s fields. Each line is one ``write`` on an ``O_APPEND`` file,
so ranks never interleave and a kill leaves at most the last line missing, never torn. Only a regular file is
written or read (:func:`~ckptverify.ownfiles.names.open_append`): a planted FIFO cannot hang a job.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from ckptverify.ownfiles.names import append_line, open_read
from ckptverify.safeparse import safejson

__all__ = ["CHECKPOINT_CUT_SHORT", "CHECKPOINT_DELETED", "CHECKPOINT_FAILED", "CHECKPOINT_UNVERIFIED",
           "CHECKPOINT_VERIFIED", "EVENTS_FILE", "EVENTS_SCHEMA_VERSION", "MAX_LINE_BYTES",
           "VERIFICATION_EVENTS", "EventLog", "event_problem", "read_events"]

EVENTS_FILE = "events.jsonl"
#: Written into every event.
EVENTS_SCHEMA_VERSION = 1
#: Longest line read as an event (ckptverify writes at most a few hundred kB).
MAX_LINE_BYTES = 8 << 20
#: Deepest nesting of an event's JSON (an event nests four levels: a finding's location in a verification).
MAX_EVENT_DEPTH = 16

#: A saved checkpoint passed verification (stamped).
CHECKPOINT_VERIFIED = "checkpoint-verified"
#: A saved checkpoint failed verification (stamped), or could not be verified at all.
CHECKPOINT_FAILED = "checkpoint-failed"
#: A saved checkpoint was left without a verdict (files changed while read, or the verification stopped).
CHECKPOINT_UNVERIFIED = "checkpoint-unverified"
#: A saved checkpoint was deleted (retention) before its verification finished: no verdict, no failure.
CHECKPOINT_DELETED = "checkpoint-deleted"
#: The job stopped waiting for a saved checkpoint's verification (at its end): no verdict.
CHECKPOINT_CUT_SHORT = "checkpoint-cut-short"
#: Events recording a saved checkpoint's verification (a ``Verification``'s fields).
VERIFICATION_EVENTS = (CHECKPOINT_VERIFIED, CHECKPOINT_FAILED, CHECKPOINT_UNVERIFIED, CHECKPOINT_DELETED,
                       CHECKPOINT_CUT_SHORT)
class EventLog:
    """Appends events to ``DIR/events.jsonl`` for one rank."""

    def __init__(self, run_dir: str | os.PathLike[str], *, rank: int = 0) -> None:
        self.path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
        self.rank = rank
        self.host = socket.gethostname()
        os.makedirs(os.fspath(run_dir), exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return it as written; ``OSError`` (including
        :class:`~ckptverify.errors.NotRegularFileError`) if it cannot be appended."""
        record: dict[str, Any] = {
            "event": event,
            "schema_version": EVENTS_SCHEMA_VERSION,
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds"),
            "rank": self.rank,
            "host": self.host,
        }
        record.update(fields)
        line = (json.dumps(record, default=str, sort_keys=False) + "\n").encode()
        # CKPTVERIFY_STRICT_EVENTS=1 (tests): an event read_events would skip is a writer bug: raise.
        if os.environ.get("CKPTVERIFY_STRICT_EVENTS") == "1":
            problem = event_problem(json.loads(line))
            if problem is not None:
                raise ValueError(f"event {event!r} would be skipped by read_events: {problem}")
        append_line(self.path, line)
        return record


def read_events(run_dir: str | os.PathLike[str], event: str | None = None, *,
                on_bad: Callable[[int, str], None] | None = None) -> Iterator[dict[str, Any]]:
    """The run's events in file order (only ``event`` ones if given);
    :class:`~ckptverify.errors.NotRegularFileError`
    if ``events.jsonl`` is not a regular file. The log is a record, not an input: a line that is not a valid event
    (:func:`event_problem`, bounded by :data:`MAX_LINE_BYTES`) is skipped with ``on_bad(line_number, why)``, never
    raised. Nothing is checked across lines; ``path`` values are as written and may name anything."""
    path = os.path.join(os.fspath(run_dir), EVENTS_FILE)
    try:
        fd = open_read(path)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        number = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES:  # skipped a block at a time: its length bounds nothing we hold
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                why = f"longer than the {MAX_LINE_BYTES} bytes of an event line"
            else:
                record, why = _parse(line)
            if why is not None:
                if on_bad is not None:
                    on_bad(number, why)
                continue
            if event is None or record["event"] == event:
                yield record


def _parse(line: bytes) -> tuple[dict[str, Any], str | None]:
    """The event on ``line``, or why it is not one."""
    try:
        record = safejson.loads(line.decode("utf-8"), max_depth=MAX_EVENT_DEPTH)
    except UnicodeDecodeError as exc:
        return {}, f"not UTF-8 ({exc.reason} at byte {exc.start})"
    except ValueError as exc:  # JSONError; a torn last line too
        return {}, str(exc)
    if not isinstance(record, dict):
        return {}, f"a JSON {type(record).__name__}, not an object"
    return record, event_problem(record)


def event_problem(record: dict[str, Any]) -> str | None:
    """Why ``record`` is not an event as ckptverify writes one (types and ranges of :data:`_FIELDS`, required fields,
    verification name/``verdict``/``passed`` agreeing), or ``None``."""
    for name in ("event", "time", "rank", "host"):
        if name not in record:
            return f"no {name!r}"
    for name, (fits, what) in _FIELDS.items():
        if name in record and not fits(record[name]):
            return f"{name!r} is {_short(record[name])}, not {what}"
    name = record["event"]
    if name in VERIFICATION_EVENTS:
        want = {CHECKPOINT_VERIFIED: "passed", CHECKPOINT_FAILED: "failed"}.get(name, "unverified")
        if record.get("verdict") != want or record.get("passed", want == "passed") != (want == "passed"):
            return (f"{name!r} with verdict {_short(record.get('verdict'))} and passed "
                    f"{_short(record.get('passed'))}: they disagree")
    return None


def _count(hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and 0 <= v <= hi


def _maybe(fits: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or fits(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


_STEP = _count((1 << 63) - 1)
#: Event fields and what each must hold, so consumers may trust their types (``docs/json-schema.md``).
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "event": (lambda v: isinstance(v, str) and 0 < len(v) <= 200, "a name"),
    "schema_version": (_count(1 << 31), "a version number"),
    "time": (_text, "a time"),
    "rank": (_count(1 << 31), "a rank"),
    "host": (_text, "a host name"),
    **{k: (_maybe(_STEP), "a step") for k in ("step", "first_step", "last_step", "agreed_at")},
    **{k: (_STEP, "a count") for k in ("bytes_checked", "mismatched_steps", "episode", "unverified",
                                       "world_size")},
    **{k: (_text, "a string") for k in ("path", "to", "verdict", "state", "site")},
    **{k: (_maybe(_text), "a string or null") for k in ("reason", "first_error", "message", "stamp", "no_verdict",
                                                        "resumed_from", "target")},
    **{k: (lambda v: type(v) is bool, "true or false") for k in ("passed", "pending", "deleted", "stamped",
                                                                 "manifest", "deep")},
    **{k: (lambda v: type(v) in (int, float) and v >= 0, "a number of seconds") for k in ("seconds",
                                                                                        "throttled_s")},
    **{k: (lambda v: isinstance(v, list), "a list") for k in ("errors", "coverage", "unchecked", "warnings",
                                                              "skipped", "group", "tensors")},
    "summary": (lambda v: isinstance(v, dict), "an object"),
}


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
