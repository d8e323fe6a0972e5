"""Verify every checkpoint of a run as it commits: ``ckptverify watch RUN_DIR``.

Each pass lists the run's checkpoints (every format ``scan`` knows) and verifies and stamps each finished one
without a current stamp, logging one JSON line per result. *Finished*: DCP committed (no save in progress); a
format without commit marker unchanged for ``quiet`` seconds. The verifying lock keeps retention away; a
checkpoint deleted meanwhile is ``deleted``, not failed. Where stamp or lock cannot be written the verdict stands
(``"stamped": false``, ``stamp_error``) and is remembered until the files change; ``error`` s retry at most once
per interval. Listing every ``interval`` is the truth; inotify (:mod:`~ckptverify.verifier.notify`) only hastens a
pass. After each pass :class:`RunState` can be written as Prometheus gauges. Log and metrics are written only as
regular files: a link, FIFO or device there is refused at start and reported, never written through, later.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError, NotRegularFileError, UsageError
from ckptverify.formats.rundir import Candidate, find_checkpoints
from ckptverify.ownfiles.gauges import render_gauges, write_gauges
from ckptverify.ownfiles.names import append_line, check_replaceable
from ckptverify.runs.stamp import SETTLE_SECONDS, committed, files_fingerprint, read_stamp
from ckptverify.runs.states import judge_report
from ckptverify.safeparse.paths import WalkNote
from ckptverify.verifier.notify import DirectoryNotifier
from ckptverify.verifier.stamper import stamp_locked, verify_and_stamp
from ckptverify.verifier.verification import Verification, unverified

__all__ = ["WATCH_HELP", "WATCH_LOG", "RunState", "WatchResult", "watch"]

#: A format without commit marker is finished once its files stayed unchanged this long.
QUIET_SECONDS = 5.0
#: The watcher's log, in the run directory unless another is given.
WATCH_LOG = "ckptverify-watch.jsonl"

#: The gauges ``watch`` writes after every pass: the state of the run, not of the last checkpoint verified.
WATCH_HELP = {
    "passed": "1 when no checkpoint of the run is known to have failed and none could not be verified, else 0",
    "errors": "checkpoints of the run that failed verification or could not be verified",
    "checkpoints": "checkpoints found by the last pass",
    "verified_checkpoints": "checkpoints of the run that passed verification (stamped or not)",
    "corrupt_checkpoints": "checkpoints of the run that failed verification (stamped or not)",
    "unverifiable_checkpoints": "checkpoints of the run that could not be verified (see the watch log)",
    "pending_checkpoints": "checkpoints not finished yet, or changed while they were verified",
    "unstamped_checkpoints": "checkpoints judged whose stamp could not be written",
    "last_good_step": "step of the newest checkpoint that passed verification (-1 when none)",
    "bytes_checked": "bytes verified by this watcher since it started",
    "passes": "passes over the run directory since the watcher started",
    "last_run_timestamp_seconds": "when the last pass ended (Unix time)",
}


@dataclass
class RunState:
    """The run as the last pass left it: checkpoints per state (earlier verdicts count by their verdict)."""

    checkpoints: int = 0
    verified: int = 0
    corrupt: int = 0
    #: Finished checkpoints that could not be verified at all (``error``).
    unverifiable: int = 0
    #: Not finished (being written, or torn), changed while being verified, or being verified by someone else.
    pending: int = 0
    #: Of ``verified`` and ``corrupt``, those whose stamp could not be written.
    unstamped: int = 0
    #: Found, then removed (or renamed away) before or while they were verified: no verdict, not a failure.
    deleted: int = 0
    last_good_step: int | None = None
    #: What the pass could not see (:meth:`WalkNote.describe` lines): neither verified nor counted.
    unseen: list[str] = field(default_factory=list)

    @property
    def judged(self) -> int:
        """Checkpoints with a verdict, passed or failed."""
        return self.verified + self.corrupt

    def gauges(self, *, bytes_checked: int, passes: int, now: float) -> dict[str, int | float]:
        """The values of :data:`WATCH_HELP`."""
        return {
            "passed": int(self.corrupt == 0 and self.unverifiable == 0),
            "errors": self.corrupt + self.unverifiable,
            "checkpoints": self.checkpoints,
            "verified_checkpoints": self.verified,
            "corrupt_checkpoints": self.corrupt,
            "unverifiable_checkpoints": self.unverifiable,
            "pending_checkpoints": self.pending,
            "unstamped_checkpoints": self.unstamped,
            "last_good_step": -1 if self.last_good_step is None else self.last_good_step,
            "bytes_checked": bytes_checked,
            "passes": passes,
            "last_run_timestamp_seconds": now,
        }


@dataclass
class WatchResult:
    """What the passes so far found: one entry per checkpoint verified (or seen failed), in order."""

    results: list[dict[str, Any]] = field(default_factory=list)
    passes: int = 0
    #: Whether change notification (inotify) woke the watcher, rather than polling alone.
    notify: bool = False
    #: The run as the last pass left it.
    state: RunState = field(default_factory=RunState)
    #: What the watcher could not record (its log, its metrics file), one message each.
    problems: list[str] = field(default_factory=list)
    #: Bytes verified by this watcher.
    bytes_checked: int = 0

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["event"] == "failed"]

    @property
    def nothing(self) -> str | None:
        """Why the last pass had nothing to judge (no finished checkpoint), or ``None`` when it had."""
        state = self.state
        if state.judged or state.unverifiable:
            return None
        if not state.checkpoints:
            return "no checkpoint found"
        if state.deleted == state.checkpoints:
            return f"{state.checkpoints} checkpoint(s) found, all removed before they could be verified"
        return f"{state.checkpoints} checkpoint(s) found, none finished (still being written, or torn)"

    @property
    def exit_code(self) -> int:
        """1 if a checkpoint failed; else 2 if one could not be verified, a result or metrics could not be recorded, or
        no checkpoint was found (a usage error); else 1 if none found was finished; else 0."""
        if self.failed:
            return 1
        if self.state.unverifiable or self.problems or self.state.checkpoints == self.state.deleted:
            return 2
        return 1 if self.nothing is not None else 0


@dataclass
class _Known:
    """A verdict this watcher reached without a stamp (or a failure to verify), with the files it is about."""

    fingerprint: str
    result: dict[str, Any]
    #: For ``error``: not tried again before this (``time.monotonic``).
    retry_at: float = 0.0


def _row(base: dict[str, Any], outcome: Verification) -> dict[str, Any]:
    """The watch log's line for ``outcome``: its verdict (``stamped``, else ``stamp_error``) with counts, or why it has
    none (a changed one is tried again)."""
    report = outcome.report
    if report is None:
        later = "; it is verified again in a later pass" if outcome.no_verdict == "changed" else ""
        return {"event": outcome.no_verdict, **base, "reason": f"{outcome.reason}{later}"}
    out = {"event": "verified" if outcome.passed else "failed", **base, "state": judge_report(report),
           "errors": len(report.errors), "warnings": len(report.warnings), "bytes": report.stats.get("bytes"),
           "seconds": round(outcome.seconds, 3)}
    if report.errors:
        first = report.errors[0]
        out["first_error"] = {"check": first.check, "message": first.message}
    out["stamped"] = outcome.stamped
    if not outcome.stamped:
        out["stamp_error"] = outcome.reason or "not stamped"
    return out


def _fingerprint(path: str) -> str:
    """The files' fingerprint, ``""`` when they cannot be listed (then any later pass tries again)."""
    try:
        return files_fingerprint(path)
    except OSError:
        return ""


def _verify_one(root: str, cand: Candidate, jobs: int | None, deep: bool,
                settle: float) -> tuple[dict[str, Any] | None, str | None]:
    """Verify and stamp one checkpoint: the result (``None`` if someone else is on it) and, for an unstamped verdict or
    an error, its files' fingerprint."""
    path = os.path.join(root, cand.path)
    outcome = verify_and_stamp(path, step=cand.step, jobs=jobs, deep=deep, settle=settle)
    if outcome.no_verdict == "busy":
        return None, None  # another watcher is on it
    if outcome.no_verdict == "error":
        # It could not be verified here (the stamper could not read it): try once more without lock or stamp.
        why = outcome.reason or "not stamped"
        try:
            outcome = stamp_locked(path, step=cand.step, jobs=jobs, deep=deep, settle=settle, unstamped=why)
        except CkptVerifyError as exc:
            outcome = unverified(path, cand.step, "error", f"{type(exc).__name__}: {exc}")
        if outcome.no_verdict == "error":
            outcome = replace(outcome, reason=f"{why}; verifying it without a stamp failed too: {outcome.reason}")
    # A verdict whose stamp could not be written stands all the same; remembered until its files change.
    remember = outcome.no_verdict == "error" or (outcome.report is not None and not outcome.stamped)
    return _row({"path": cand.path, "step": cand.step}, outcome), _fingerprint(path) if remember else None


def _ready(path: str, cand: Candidate, quiet: float) -> bool:
    """Whether a checkpoint is finished: DCP committed (every DCP part), or otherwise unchanged for ``quiet`` seconds.
    """
    if cand.format == "dcp":
        return committed(path)
    if cand.format == "dcp-uncommitted":
        return False
    return all(committed(os.path.join(path, part)) for part in cand.parts) \
        and time.time_ns() - cand.mtime_ns >= quiet * 1e9


#: The :class:`RunState` count of each result event (any other: ``pending``).
_COUNTS = {"verified": "verified", "failed": "corrupt", "error": "unverifiable", "deleted": "deleted"}


def _count(state: RunState, event: str, step: int | None, stamped: bool = True) -> None:
    name = _COUNTS.get(event, "pending")
    setattr(state, name, getattr(state, name) + 1)
    if event == "verified" and step is not None and (state.last_good_step is None or step > state.last_good_step):
        state.last_good_step = step
    if event in ("verified", "failed") and not stamped:
        state.unstamped += 1


def _pass(root: str, *, jobs: int | None, deep: bool, settle: float, quiet: float,
          known: dict[str, _Known], retry: float) -> tuple[list[dict[str, Any]], RunState]:
    """One pass: verify and stamp every finished, unstamped (or stale) checkpoint; report failed stamps. One result per
    checkpoint acted on: ``verified``, ``failed``, ``deleted``, ``changed`` or ``error``; ``verified``/``failed`` carry
    ``stamped`` (``false`` with ``stamp_error`` when unwritable; the verdict stands). ``known``: unstamped verdicts and
    errors remembered across passes."""
    out: list[dict[str, Any]] = []
    state = RunState()
    seen: set[str] = set()
    notes: list[WalkNote] = []
    candidates = find_checkpoints(root, notes=notes)
    state.unseen = [n.describe() for n in notes]
    for cand in candidates:
        state.checkpoints += 1
        seen.add(cand.path)
        path = os.path.join(root, cand.path)
        if not _ready(path, cand, quiet):
            state.pending += 1
            continue
        stamp = read_stamp(path)
        if stamp is not None and stamp.current:
            known.pop(cand.path, None)
            _count(state, "verified" if stamp.passed else "failed", cand.step)
            if not stamp.passed:
                out.append({"event": "failed", "path": cand.path, "step": cand.step, "state": "corrupt",
                            "stamped": True, "checked_at": stamp.data.get("checked_at")})
            continue
        memory = known.get(cand.path)
        if memory is not None:
            unchanged = _fingerprint(path) == memory.fingerprint
            event = memory.result["event"]
            if unchanged and (event != "error" or time.monotonic() < memory.retry_at):
                _count(state, event, cand.step, stamped=False)  # judged (or tried) already: nothing new
                continue
        result, fingerprint = _verify_one(root, cand, jobs, deep, settle)
        if result is None:
            state.pending += 1  # someone else is verifying it
            continue
        _count(state, result["event"], cand.step, stamped=result.get("stamped", True))
        if fingerprint and result["event"] in ("verified", "failed", "error"):
            known[cand.path] = _Known(fingerprint, result, retry_at=time.monotonic() + retry)
        else:
            known.pop(cand.path, None)
        out.append(result)
    for gone in set(known) - seen:
        del known[gone]
    return out, state


def _check_output(path: str, what: str) -> None:
    """Refuse, before anything is verified, an output file that could never be written."""
    try:
        check_replaceable(path)
    except NotRegularFileError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror}") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{what} {path}: its directory {folder} does not exist")


def watch(run_dir: str | os.PathLike[str], *, once: bool = False, interval: float = 2.0,
          exit_on_failure: bool = False, log: str | None = None, jobs: int | None = None, deep: bool = False,
          max_passes: int | None = None, on_result: Callable[[dict[str, Any]], None] | None = None,
          notify: bool = True, quiet: float = QUIET_SECONDS, metrics_file: str | None = None,
          on_problem: Callable[[str], None] | None = None, settle: float = SETTLE_SECONDS) -> WatchResult:
    """Watch ``run_dir`` (see the module docstring) until one pass with ``once``, the first failure with
    ``exit_on_failure``, ``max_passes``, or ``KeyboardInterrupt``.

    ``log``: JSON lines file (default ``RUN_DIR/ckptverify-watch.jsonl``). ``notify``: wake on inotify changes.
    ``quiet``: see :data:`QUIET_SECONDS`. ``metrics_file``: Prometheus gauges after each pass. ``on_problem``: called
    once per distinct recording problem (then exit code 2). Raises :class:`~ckptverify.errors.CheckpointNotFoundError`
    (not a directory) and :class:`~ckptverify.errors.UsageError` (log or metrics not a regular file, or no directory).
    """
    root = os.fspath(run_dir)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a directory: {root}")
    log_path = log or os.path.join(root, WATCH_LOG)
    _check_output(log_path, "cannot append to the watch log")
    if metrics_file is not None:
        _check_output(metrics_file, "cannot write the metrics file")
    result = WatchResult()
    reported_failures: set[tuple[str, str | None]] = set()
    known: dict[str, _Known] = {}

    def problem(message: str) -> None:
        if message not in result.problems:
            result.problems.append(message)
            if on_problem is not None:
                on_problem(message)

    ignore = {os.path.basename(p) for p in (log_path, metrics_file) if p is not None}
    notifier = DirectoryNotifier.open(root, ignore_names=ignore) if notify and not once else None
    result.notify = notifier is not None
    try:
        while True:
            items, result.state = _pass(root, jobs=jobs, deep=deep, settle=settle, quiet=quiet, known=known,
                                        retry=interval)
            for item in items:
                key = (item["path"], item.get("checked_at"))
                if item.get("stamped") and item.get("checked_at") and key in reported_failures:
                    continue  # a failed stamp is reported once per watcher, not every pass
                reported_failures.add(key)
                item = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **item}
                result.results.append(item)
                result.bytes_checked += int(item.get("bytes") or 0)
                try:  # a regular file only, never through a link, FIFO or device
                    append_line(log_path, (json.dumps(item, default=str) + "\n").encode("utf-8", "surrogateescape"))
                except OSError as exc:
                    problem(f"cannot append to the watch log {log_path}: {exc}")
                if on_result is not None:
                    on_result(item)
            for unseen in result.state.unseen:
                # a pass that could not see part of the run cannot say the run is good
                problem(f"part of {root} was not seen: {unseen}")
            result.passes += 1
            if metrics_file is not None:
                _write_gauges(metrics_file, root, result, problem)
            if once or (exit_on_failure and result.failed) or (max_passes and result.passes >= max_passes):
                return result
            if notifier is not None:
                notifier.wait(interval)
            else:
                time.sleep(interval)
    except KeyboardInterrupt:
        return result
    finally:
        if notifier is not None:
            notifier.close()


def _write_gauges(path: str, root: str, result: WatchResult, problem: Callable[[str], None]) -> None:
    values = result.state.gauges(bytes_checked=result.bytes_checked, passes=result.passes, now=time.time())
    try:
        write_gauges(path, render_gauges("watch", root, values, WATCH_HELP))
    except OSError as exc:
        problem(f"cannot write the metrics file {path}: {exc}")

