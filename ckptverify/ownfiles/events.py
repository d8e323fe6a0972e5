"""``events.jsonl``: the append-only log of what happened to a production run.

One JSON object per line, each with ``event`` (a stable name: ``save``, ``replica-mismatch``,
``checkpoint-verified``, ...), ``schema_version`` (:data:`EVENTS_SCHEMA_VERSION`), ``time`` (UTC, ISO 8601),
``rank`` and ``host``, plus the event's own fields; every name and its fields are listed in
``docs/json-schema.md``.

A checkpoint's verification after it was saved (by a save with ``verify=``, a production run, or a framework
integration) is one of the :data:`VERIFICATION_EVENTS`, whose fields are those of
:class:`~ckptverify.verifier.verification.Verification`. Every line is written with one
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
from collections.abc import Callable, Iterator
from typing import Any

from ckptverify.ownfiles.names import append_line, open_read
from ckptverify.safeparse import safejson

__all__ = ["CHECKPOINT_CUT_SHORT", "CHECKPOINT_DELETED", "CHECKPOINT_FAILED", "CHECKPOINT_UNVERIFIED",
           "CHECKPOINT_VERIFIED", "EVENTS_FILE", "EVENTS_SCHEMA_VERSION", "MAX_LINE_BYTES",
           "VERIFICATION_EVENTS", "EventLog", "event_problem", "read_events"]

EVENTS_FILE = "events.jsonl"
#: Written into every event.
EVENTS_SCHEMA_VERSION = 2
#: Longest line :func:`read_events` reads as an event (the longest ckptverify writes is a few hundred kB: a
#: replica mismatch naming every tensor of a large model).
MAX_LINE_BYTES = 8 << 20
#: Deepest nesting of an event's JSON (an event nests four levels: a finding's location in a verification).
MAX_EVENT_DEPTH = 16

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
        # CKPTVERIFY_STRICT_EVENTS=1 (set by the test suite, inherited by the jobs it starts): an event that
        # read_events would skip is a bug in its writer, raised rather than written.
        if os.environ.get("CKPTVERIFY_STRICT_EVENTS") == "1":
            problem = event_problem(json.loads(line))
            if problem is not None:
                raise ValueError(f"event {event!r} would be skipped by read_events: {problem}")
        append_line(self.path, line)
        return record


def read_events(run_dir: str | os.PathLike[str], event: str | None = None, *,
                on_bad: Callable[[int, str], None] | None = None) -> Iterator[dict[str, Any]]:
    """The events of a run, in file order (optionally only those named ``event``). Raises
    :class:`~ckptverify.ownfiles.names.NotRegularFileError` when ``events.jsonl`` is not a regular file.

    The log is a record, not an input: a line that is not an event as ckptverify writes it (a torn last line,
    invalid UTF-8 or JSON, NaN, a repeated key, deep nesting, a line over :data:`MAX_LINE_BYTES`, not an object,
    a field of the wrong type or out of range, a verification whose ``verdict``, ``passed`` and name disagree:
    :func:`event_problem`) is skipped, never raised, and ``on_bad(line_number, why)`` is called for it. Nothing
    is reordered or checked across lines (ranks append concurrently, a restarted job repeats steps), and
    ``path`` is as written: it may name anything, a URL or a folder outside ``run_dir`` among them."""
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
    """Why ``record`` is not an event as ckptverify writes one, or
    ``None``: the fields of :data:`_FIELDS` must hold their type and range, ``event``, ``time``, ``rank`` and
    ``host`` must be there, and a verification's name, ``verdict`` and ``passed`` must agree."""
    for name in ("event", "time", "rank", "host"):
        if name not in record:
            return f"no {name!r}"
    for name, (fits, what) in _FIELDS.items():
        if name in record and not fits(record[name]):
            return f"{name!r} is {_short(record[name])}, not {what}"
    name = record["event"]
    if name in VERIFICATION_EVENTS:
        want = _verdict_of(name)
        if record.get("verdict") != want or record.get("passed", want == "passed") != (want == "passed"):
            return (f"{name!r} with verdict {_short(record.get('verdict'))} and passed "
                    f"{_short(record.get('passed'))}: they disagree")
    return None


def _verdict_of(name: str) -> str:
    """The verdict a verification event of ``name`` (:data:`VERIFICATION_EVENTS`) records."""
    return {CHECKPOINT_VERIFIED: "passed", CHECKPOINT_FAILED: "failed"}.get(name, "unverified")


def _count(hi: int) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and 0 <= v <= hi


def _maybe(fits: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or fits(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


_STEP = _count((1 << 63) - 1)
#: The fields an event may carry and what each must hold (``docs/json-schema.md``): a consumer may use them as
#: their type says without checking (``step`` an ``int``, ``passed`` a ``bool``, ...).
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
