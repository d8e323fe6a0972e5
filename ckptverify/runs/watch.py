"""Verify every checkpoint of a run as it commits: ``ckptverify watch RUN_DIR``.

Each pass lists the run's checkpoints (:func:`~ckptverify.formats.rundir.find_checkpoints`: every format
``scan`` knows), and every finished checkpoint without a current stamp is verified and stamped
(:mod:`~ckptverify.runs.stamp`), with one JSON line appended to the log for each result. *Finished* means, for
DCP, its ``.metadata`` is in place and no ckptverify save is in progress in it (every DCP part, for a folder
holding several); for a format without a commit marker (a Hugging Face or accelerate folder, a ``.ckpt`` or
``.safetensors`` file), that none of its files changed for ``quiet`` seconds. A checkpoint still being written
is left for a later pass. While verifying a directory, the watcher holds its verifying lock, so retention
(:func:`~ckptverify.runs.prune.prune`) leaves it alone (a single file has no lock). A checkpoint deleted while
being verified (retention elsewhere) is logged as ``deleted``, not as a failure.

The directory is listed at least every ``interval`` seconds, which works the same on local and network file
systems; where Linux ``inotify`` is available (:mod:`~ckptverify.runs.notify`), a change in the run directory or
in a checkpoint directory wakes the watcher at once, so a pass follows a save within a fraction of a second.
Notification only hastens a pass: the listing stays the source of truth, so a lost event costs at most one
interval.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptverify.errors import CheckpointNotFoundError, CkptVerifyError
from ckptverify.formats.rundir import Candidate, find_checkpoints
from ckptverify.runs.scan import judge_report
from ckptverify.runs.stamp import read_stamp
from ckptverify.runs.stamper import SETTLE_SECONDS, committed, verify_and_stamp

__all__ = ["WatchResult", "watch", "watch_pass"]

#: A checkpoint of a format without a commit marker is taken for finished once none of its files changed for
#: this long (a save still writing keeps touching its files).
QUIET_SECONDS = 5.0


@dataclass
class WatchResult:
    """What the passes so far found: one entry per checkpoint verified (or seen failed), in order."""

    results: list[dict[str, Any]] = field(default_factory=list)
    passes: int = 0
    #: Whether change notification (inotify) woke the watcher, rather than polling alone.
    notify: bool = False

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["event"] == "failed"]


def _verify_one(root: str, cand: Candidate, jobs: int | None, deep: bool, settle: float) -> dict[str, Any] | None:
    path = os.path.join(root, cand.path)
    base = {"path": cand.path, "step": cand.step}
    outcome = verify_and_stamp(path, step=cand.step, jobs=jobs, deep=deep, settle=settle)
    if outcome.event == "busy":
        return None  # another watcher is on it
    if outcome.event == "changed":
        return {"event": "changed", **base, "reason": f"{outcome.reason}; it is verified again in a later pass"}
    if outcome.report is None:
        return {"event": outcome.event, **base, "reason": outcome.reason}
    report = outcome.report
    out = {"event": outcome.event, **base, "state": judge_report(report), "errors": len(report.errors),
           "warnings": len(report.warnings), "bytes": report.stats.get("bytes"),
           "seconds": round(outcome.seconds, 3)}
    if report.errors:
        first = report.errors[0]
        out["first_error"] = {"check": first.check, "message": first.message}
    return out


def _ready(path: str, cand: Candidate, quiet: float) -> bool:
    """Whether a checkpoint is finished: a DCP save committed (every DCP part of a composite one); a format
    without a commit marker (a Hugging Face or accelerate folder, a single file) unchanged for ``quiet``
    seconds."""
    if cand.format == "dcp":
        return committed(path)
    if cand.format == "dcp-uncommitted":
        return False
    if any(not committed(os.path.join(path, part)) for part in cand.parts):
        return False
    return time.time_ns() - cand.mtime_ns >= quiet * 1e9


def watch_pass(run_dir: str, *, jobs: int | None = None, deep: bool = False,
               settle: float = SETTLE_SECONDS, quiet: float = QUIET_SECONDS) -> list[dict[str, Any]]:
    """One pass: verify and stamp every finished, unstamped (or stale) checkpoint of any format ``scan``
    knows; report failed stamps.

    Returns one result per checkpoint acted on: ``verified``, ``failed`` (a new failure, or a current stamp that
    says failed), ``deleted``, ``changed`` (its files changed during the verification: no verdict, no stamp) or
    ``error``.
    """
    root = os.fspath(run_dir)
    out: list[dict[str, Any]] = []
    for cand in find_checkpoints(root):
        path = os.path.join(root, cand.path)
        if not _ready(path, cand, quiet):
            continue
        stamp = read_stamp(path)
        if stamp is not None and stamp.current:
            if not stamp.passed:
                out.append({"event": "failed", "path": cand.path, "step": cand.step, "state": "corrupt",
                            "stamped": True, "checked_at": stamp.data.get("checked_at")})
            continue
        result = _verify_one(root, cand, jobs, deep, settle)
        if result is not None:
            out.append(result)
    return out


def watch(run_dir: str | os.PathLike[str], *, once: bool = False, interval: float = 2.0,
          exit_on_failure: bool = False, log: str | None = None, jobs: int | None = None, deep: bool = False,
          max_passes: int | None = None, on_result: Callable[[dict[str, Any]], None] | None = None,
          notify: bool = True, quiet: float = QUIET_SECONDS) -> WatchResult:
    """Watch ``run_dir``; see the module docstring. Returns when ``once`` (after one pass), at the first failure
    with ``exit_on_failure``, after ``max_passes`` passes, or on ``KeyboardInterrupt``.

    ``log``: a file to append one JSON line per result to (default: ``RUN_DIR/ckptverify-watch.jsonl``).
    ``notify``: wake at once on changes where inotify is available (else, and with ``False``: poll only).
    ``quiet``: how long a checkpoint without a commit marker must stay unchanged to be taken for finished.
    """
    from ckptverify.runs.notify import DirectoryNotifier

    root = os.fspath(run_dir)
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"not a directory: {root}")
    log_path = log or os.path.join(root, "ckptverify-watch.jsonl")
    result = WatchResult()
    reported_failures: set[tuple[str, str | None]] = set()
    notifier = DirectoryNotifier.open(root) if notify and not once else None
    result.notify = notifier is not None
    try:
        while True:
            for item in watch_pass(root, jobs=jobs, deep=deep, quiet=quiet):
                key = (item["path"], item.get("checked_at"))
                if item.get("stamped") and key in reported_failures:
                    continue  # a failed stamp is reported once per watcher, not every pass
                reported_failures.add(key)
                item = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **item}
                result.results.append(item)
                _append(log_path, item)
                if on_result is not None:
                    on_result(item)
            result.passes += 1
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


def _append(path: str, item: dict[str, Any]) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise CkptVerifyError(f"cannot append to the watch log {path}: {exc}") from None
    try:
        os.write(fd, (json.dumps(item, default=str) + "\n").encode())
    finally:
        os.close(fd)
