"""Prometheus text-format gauges for a report, for node exporters' textfile collectors.

``--metrics-file PATH`` on ``verify`` and ``scan`` writes, atomically (a temporary file in the same folder,
then ``rename``, so a collector never reads half a file), gauges such as::

    ckptverify_passed{command="verify",target="/ckpt/step_100"} 1
    ckptverify_errors{command="verify",target="/ckpt/step_100"} 0
    ckptverify_bytes_checked{command="verify",target="/ckpt/step_100"} 8.589934592e+09
    ckptverify_seconds{command="verify",target="/ckpt/step_100"} 1.94
    ckptverify_last_run_timestamp_seconds{command="verify",target="/ckpt/step_100"} 1.796e+09
    ckptverify_last_good_step{command="scan",target="/runs/a"} 1200

Alert on ``ckptverify_passed == 0`` or on a stale ``ckptverify_last_run_timestamp_seconds``.
"""

from __future__ import annotations

import os
import time

from ckptverify.findings import Report
from ckptverify.own_files import METRICS_TEMP_PREFIX, write_atomic

__all__ = ["render_metrics", "write_metrics"]

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


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(report: Report, *, now: float | None = None) -> str:
    """The gauges for ``report`` in the Prometheus text exposition format."""
    stats = report.stats
    counts = report.summary()
    values: dict[str, float] = {
        "passed": 1.0 if report.passed else 0.0,
        "errors": counts["error"],
        "warnings": counts["warning"],
        "bytes_checked": float(stats.get("bytes", 0) or 0),
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
    labels = f'command="{_label(report.command)}",target="{_label(report.target)}"'
    lines = []
    for name, value in values.items():
        metric = f"ckptverify_{name}"
        lines += [f"# HELP {metric} {_HELP[name]}", f"# TYPE {metric} gauge", f"{metric}{{{labels}}} {value:g}"]
    return "\n".join(lines) + "\n"


def write_metrics(path: str | os.PathLike[str], report: Report) -> None:
    """Write :func:`render_metrics` to ``path`` atomically."""
    write_atomic(path, render_metrics(report), prefix=METRICS_TEMP_PREFIX, durable=False)
