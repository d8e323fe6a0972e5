"""Prometheus text-format gauges for a report, for node exporters' textfile collectors.

``--metrics-file PATH`` on every command that checks (``verify``, ``fingerprint``, ``diff``, ``scan``, ``latest``,
``watch``, ``resume-check``, ``replay``, ``trace diff``) writes, atomically (a temporary file in the same
folder, then ``rename``, so a collector never reads half a file), gauges such as::

    ckptverify_passed{command="verify",target="/ckpt/step_100"} 1
    ckptverify_errors{command="verify",target="/ckpt/step_100"} 0
    ckptverify_bytes_checked{command="verify",target="/ckpt/step_100"} 8589934592
    ckptverify_seconds{command="verify",target="/ckpt/step_100"} 1.94
    ckptverify_last_run_timestamp_seconds{command="verify",target="/ckpt/step_100"} 1796000000.25
    ckptverify_last_good_step{command="scan",target="/runs/a"} 1200

``watch`` writes the state of the run after every pass (:data:`~ckptverify.verifier.watch.WATCH_HELP`, through
:mod:`ckptverify.ownfiles.gauges`, which the core may import). Integers
are written as integers and other numbers with every digit (``repr``), never rounded to six digits; a label
value that is not valid UTF-8 (a file name's raw bytes) has each such byte written as ``\\xNN``.

The file is replaced only when it is a regular file (:func:`~ckptverify.ownfiles.names.write_atomic`): a symbolic
link, FIFO or device at ``PATH`` is refused, never replaced or written through.

Alert on ``ckptverify_passed == 0`` or on a stale ``ckptverify_last_run_timestamp_seconds``.
"""

from __future__ import annotations

import os
import time

from ckptverify.findings import Report
from ckptverify.ownfiles.gauges import format_value, render_gauges, write_gauges
from ckptverify.verifier.watch import WATCH_HELP

# format_value, render_gauges, write_gauges and WATCH_HELP are re-exported: their homes are below the core
# (ownfiles.gauges: the file format; verifier.watch: the watcher's gauges), which never imports render.
__all__ = ["WATCH_HELP", "format_value", "render_gauges", "render_metrics", "write_gauges", "write_metrics"]

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
        # A corrupt checkpoint the job moved aside and recovered past is handled: an alert on this gauge clears.
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
