"""Prometheus text-format gauges for a report, for node exporters' textfile collectors.

``--metrics-file PATH`` on ``verify``, ``scan`` and ``replay`` writes, atomically (a temporary file in the same
folder, then ``rename``, so a collector never reads half a file), gauges such as::

    ckptverify_passed{command="verify",target="/ckpt/step_100"} 1
    ckptverify_errors{command="verify",target="/ckpt/step_100"} 0
    ckptverify_bytes_checked{command="verify",target="/ckpt/step_100"} 8589934592
    ckptverify_seconds{command="verify",target="/ckpt/step_100"} 1.94
    ckptverify_last_run_timestamp_seconds{command="verify",target="/ckpt/step_100"} 1796000000.25
    ckptverify_last_good_step{command="scan",target="/runs/a"} 1200

``watch`` writes the state of the run after every pass (:func:`write_gauges`, :data:`WATCH_HELP`). Integers
are written as integers and other numbers with every digit (``repr``), never rounded to six digits; a label
value that is not valid UTF-8 (a file name's raw bytes) has each such byte written as ``\\xNN``.

The file is replaced only when it is a regular file (:func:`~ckptverify.ownfiles.names.write_atomic`): a symbolic
link, FIFO or device at ``PATH`` is refused, never replaced or written through.

Alert on ``ckptverify_passed == 0`` or on a stale ``ckptverify_last_run_timestamp_seconds``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping

from ckptverify.findings import Report
from ckptverify.ownfiles.names import METRICS_TEMP_PREFIX, write_atomic

__all__ = ["WATCH_HELP", "format_value", "render_gauges", "render_metrics", "write_gauges", "write_metrics"]

_HELP = {
    "passed": "1 when the last run passed (no error finding), else 0",
    "errors": "error findings of the last run",
    "warnings": "warning findings of the last run",
    "bytes_checked": "bytes the last run read and checked",
    "seconds": "wall time of the last run",
    "last_run_timestamp_seconds": "when the last run ended (Unix time)",
    "checkpoints": "checkpoints found by the last scan",
    "corrupt_checkpoints": "checkpoints the last scan found corrupt",
    "last_good_step": "step of the newest verified or intact checkpoint (scan; -1 when none)",
}

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


def format_value(value: float | int | bool) -> str:
    """A sample value as the text format wants it: an integer exactly, any other number with every digit
    (``repr``: it reads back as the same float), ``NaN``, ``+Inf`` and ``-Inf``."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**63:
        return str(int(value))
    return repr(value)


def _label(value: str) -> str:
    # A path from the file system may hold bytes that are not UTF-8 (decoded as lone surrogates): the text
    # format is UTF-8, so such a byte is written as the four characters \xNN.
    text = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_gauges(command: str, target: str, values: Mapping[str, float | int | bool],
                  help_texts: Mapping[str, str]) -> str:
    """``values`` as gauges ``ckptverify_NAME{command=...,target=...}`` in the Prometheus text exposition
    format, each with its ``# HELP`` (from ``help_texts``) and ``# TYPE`` line."""
    labels = f'command="{_label(command)}",target="{_label(target)}"'
    lines = []
    for name, value in values.items():
        metric = f"ckptverify_{name}"
        lines += [f"# HELP {metric} {help_texts[name]}", f"# TYPE {metric} gauge",
                  f"{metric}{{{labels}}} {format_value(value)}"]
    return "\n".join(lines) + "\n"


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
        values["corrupt_checkpoints"] = sum(1 for r in rows if r.get("state") == "corrupt")
        step = newest.get("step")
        values["last_good_step"] = -1 if step is None else step
    return render_gauges(report.command, report.target, values, _HELP)


def write_gauges(path: str | os.PathLike[str], text: str) -> None:
    """Write rendered gauges to ``path`` atomically; only a regular file there is replaced (``OSError``,
    :class:`~ckptverify.ownfiles.names.NotRegularFileError` for anything else)."""
    write_atomic(path, text.encode("utf-8"), prefix=METRICS_TEMP_PREFIX, durable=False)


def write_metrics(path: str | os.PathLike[str], report: Report) -> None:
    """Write :func:`render_metrics` to ``path`` atomically (see :func:`write_gauges`)."""
    write_gauges(path, render_metrics(report))
