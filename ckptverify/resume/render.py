"""How ``resume-check`` shows its outcome: the findings, then the verdict as the last line.

A front end (like :mod:`ckptverify.report`): it prints, and imports rich only when called.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

__all__ = ["emit_resume", "log_dir_for"]


def log_dir_for(keep: str | None) -> str:
    """Where the workload's per-rank logs go when stdout must stay clean: ``<keep>/logs``, or a fresh
    directory that outlives the check (its files are named in the report)."""
    if keep:
        return os.path.join(os.path.abspath(keep), "logs")
    return tempfile.mkdtemp(prefix="ckptverify-logs-")


def emit_resume(outcome: Any, json_out: bool) -> int:
    """Print ``outcome`` (JSON only, or the rich table then the verdict line); return the exit code."""
    from ckptverify.report import printable, render_text, to_json

    report = outcome.report
    if json_out:
        print(to_json(report))
        return int(report.exit_code)
    from rich.console import Console
    from rich.markup import escape

    # emoji=False: a target such as `train.py:train` must not become an emoji code.
    console = Console(highlight=False, emoji=False)
    render_text(report, console)
    logs = report.stats.get("logs")
    if logs:
        console.print(f"[dim]workload output: {escape(printable(', '.join(logs)))}[/]")
    page = report.stats.get("report_page")
    if page:
        console.print(f"report: {escape(printable(page))}")
    verdict = outcome.verdict
    style = "bold green" if verdict.passed else "bold red"
    console.print(f"[{style}]{escape(printable(verdict.headline()))}[/]")
    return int(report.exit_code)
