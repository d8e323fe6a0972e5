"""Prometheus text-format gauges of a report (``--metrics-file PATH``), for textfile collectors, e.g.
``ckptverify_passed{command="verify",target="/ckpt/step_100"} 1``; alert on ``ckptverify_passed == 0`` or a stale
``ckptverify_last_run_timestamp_seconds``.

Traps: the file is replaced atomically (a collector never reads half) and only when it is a regular file (a link,
FIFO or device is refused); numbers keep every digit; non-UTF-8 label bytes are written as ``\\xNN``."""

from __future__ import annotations

import os
import time

from ckptverify.findings import Report
from ckptverify.ownfiles.gauges import render_gauges, write_gauges

__all__ = ["render_metrics", "write_metrics"]

_HELP = {
    "passed": "1 when the last run passed (no error finding), else 0",
    "errors": "error findings of the last run",
    "warnings": "warning findings of the last run",
    "bytes_checked": "bytes the last run read and checked",
    "seconds": "wall time of the last run",
    "last_run_timestamp_seconds": "when the last run ended (Unix time)",
    "checkpoints": "checkpoints found by the last scan",
    "corrupt_checkpoints": "checkpoints the last scan found corrupt and not handled (a quarantined one the job "
                           "recovered past is handled)",
    "last_good_step": "step of the newest verified or intact checkpoint (scan, latest; -1 when none)",
}


def render_metrics(report: Report, *, now: float | None = None) -> str:
    """The gauges for ``report`` in the Prometheus text exposition format."""
    stats = report.stats
    counts = report.summary()
    values: dict[str, float | int] = {
        "passed": 1 if report.passed else 0,
        "errors": counts["error"],
        "warnings": counts["warning"],
        "bytes_checked": int(stats.get("bytes", 0) or 0),
        "seconds": float(stats.get("seconds", 0) or 0),
        "last_run_timestamp_seconds": time.time() if now is None else now,
    }
    if report.command == "scan":
        rows = stats.get("checkpoints", [])
        newest = stats.get("newest_good") or {}
        values["checkpoints"] = len(rows)
        # Handled (quarantined and recovered past) ones do not count, so an alert clears.
        values["corrupt_checkpoints"] = sum(1 for r in rows if r.get("state") == "corrupt"
                                            and not r.get("handled_by"))
        step = newest.get("step")
        values["last_good_step"] = -1 if step is None else step
    elif report.command == "latest":
        step = stats.get("step") if stats.get("path") is not None else None
        values["last_good_step"] = -1 if step is None else step
    return render_gauges(report.command, report.target, values, _HELP)


def write_metrics(path: str | os.PathLike[str], report: Report) -> None:
    """Write :func:`render_metrics` to ``path`` atomically (see :func:`write_gauges`)."""
    write_gauges(path, render_metrics(report))
